"""lm-evaluation-harness against pyml-serve: a multiple-choice task from a local JSON file through
`--model local-completions` (echo + logprobs on /v1/completions) gives the accuracy lm-eval's own `hf`
backend gives on the same F32 SmolLM2 weights (transformers reading the GGUF), within 1 point, and
every choice's log-likelihood within 1e-3. The command is docs/serving.md's. lm-eval comes from the
`eval` extra (.ci/run installs it); the hub is never reached (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE)."""

import json
import os
import subprocess
import sys

import pytest

from tests.cli.test_serve import HOST, serving

# deep: two lm-eval runs (its hf backend loads transformers: ~2 min); the values' oracle test is
# tests/nlp/test_logprobs.py, the server's echo format tests/cli/test_serve_logprobs.py
pytestmark = pytest.mark.deep

QUESTIONS = [  # (question, choices, index of the answer): general knowledge a 135M model half knows
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("What is the capital of Italy?", ["Vienna", "Rome", "Lisbon", "Oslo"], 1),
    ("How many legs does a spider have?", ["Six", "Four", "Eight", "Ten"], 2),
    ("What colour is the sky on a clear day?", ["Green", "Red", "Yellow", "Blue"], 3),
    ("Which animal says moo?", ["Cow", "Cat", "Dog", "Duck"], 0),
    ("What is two plus two?", ["Three", "Four", "Five", "Six"], 1),
    ("Which planet do we live on?", ["Mars", "Venus", "Earth", "Jupiter"], 2),
    ("What do bees make?", ["Milk", "Silk", "Wool", "Honey"], 3),
    ("Which season is the coldest?", ["Winter", "Summer", "Spring", "Autumn"], 0),
    ("What is frozen water called?", ["Steam", "Ice", "Sand", "Glass"], 1),
    ("How many days are in a week?", ["Five", "Six", "Seven", "Eight"], 2),
    ("Which organ pumps blood through the body?", ["Liver", "Lung", "Kidney", "Heart"], 3),
    ("What is the largest ocean on Earth?", ["Pacific", "Atlantic", "Indian", "Arctic"], 0),
    ("Which gas do plants take in from the air?", ["Oxygen", "Carbon dioxide", "Helium", "Neon"], 1),
    ("What is the opposite of hot?", ["Warm", "Wet", "Cold", "Loud"], 2),
    ("Which animal is known as the king of the jungle?", ["Mouse", "Horse", "Rabbit", "Lion"], 3),
    ("What language is spoken in Spain?", ["Spanish", "German", "Japanese", "Russian"], 0),
    ("How many hours are in a day?", ["Twelve", "Twenty-four", "Thirty", "Sixty"], 1),
    ("What do you use to write on a blackboard?", ["Spoon", "Brush", "Chalk", "Knife"], 2),
    ("Which fruit is yellow and curved?", ["Apple", "Grape", "Cherry", "Banana"], 3),
    ("What is the capital of Japan?", ["Tokyo", "Beijing", "Seoul", "Bangkok"], 0),
    ("Which bird cannot fly?", ["Eagle", "Penguin", "Sparrow", "Pigeon"], 1),
    ("What is the boiling point of water in Celsius?", ["Fifty", "Seventy", "One hundred", "Two hundred"], 2),
    ("Who wrote Romeo and Juliet?", ["Dickens", "Tolstoy", "Homer", "Shakespeare"], 3),
    ("Which metal is liquid at room temperature?", ["Mercury", "Iron", "Gold", "Copper"], 0),
    ("What is the closest star to the Earth?", ["Sirius", "The Sun", "Polaris", "Vega"], 1),
    ("How many continents are there?", ["Three", "Five", "Seven", "Nine"], 2),
    ("What do caterpillars turn into?", ["Spiders", "Worms", "Beetles", "Butterflies"], 3),
    ("Which instrument has black and white keys?", ["Piano", "Drum", "Flute", "Violin"], 0),
    ("What is the main language of Brazil?", ["Spanish", "Portuguese", "French", "English"], 1),
    ("Which shape has three sides?", ["Square", "Circle", "Triangle", "Hexagon"], 2),
    ("What is the tallest animal?", ["Elephant", "Horse", "Camel", "Giraffe"], 3),
    ("What is the capital of Germany?", ["Berlin", "Munich", "Hamburg", "Vienna"], 0),
    ("Which month comes after January?", ["March", "February", "December", "June"], 1),
    ("What do cows drink?", ["Milk", "Juice", "Water", "Oil"], 2),
    ("Which sense do ears give us?", ["Sight", "Taste", "Smell", "Hearing"], 3),
    ("What is the colour of grass?", ["Green", "Purple", "Orange", "Black"], 0),
    ("Which vehicle travels on rails?", ["Bicycle", "Train", "Boat", "Plane"], 1),
    ("How many minutes are in an hour?", ["Thirty", "Forty", "Sixty", "Hundred"], 2),
    ("What is the capital of England?", ["Paris", "Dublin", "Madrid", "London"], 3),
]
TASK = """task: pyml_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval_task")
    with open(d / "questions.jsonl", "w") as f:
        for q, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    (d / "pyml_mc.yaml").write_text(TASK.format(data=d / "questions.jsonl"))
    return d


def lm_eval(task_dir, out, model: str, model_args: str, *flags: str) -> tuple[float, list]:
    """One `lm-eval run` (docs/serving.md's command): the accuracy and each question's choice scores."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args,
                           "--device", "cpu", "--tasks", "pyml_mc", "--include_path", str(task_dir),
                           "--output_path", str(out), "--log_samples", *flags],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in next(out.rglob("samples_pyml_mc_*.jsonl")).read_text().splitlines()]
    scores = [[float(r[0][0]) for r in s["resps"]] for s in sorted(samples, key=lambda s: s["doc_id"])]
    return results["results"]["pyml_mc"]["acc,none"], scores


def test_lm_eval_local_completions_matches_its_hf_backend(task_dir, requantized, tmp_path):
    pytest.importorskip("lm_eval")
    from transformers import AutoTokenizer
    path = requantized("f32")
    tokenizer_dir = tmp_path / "tokenizer"  # lm-eval counts the context's tokens with it: the file's own
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tokenizer_dir)
    with serving(path, "--kv-type", "f32", "--alias", "smollm2") as served:
        ours, our_scores = lm_eval(task_dir, tmp_path / "pyml", "local-completions",
                                   f"model=smollm2,base_url=http://{HOST}:{served.port}/v1/completions,"
                                   f"tokenizer_backend=huggingface,tokenizer={tokenizer_dir},max_retries=1", "--batch_size", "8")
    theirs, their_scores = lm_eval(task_dir, tmp_path / "hf", "hf",
                                   f"pretrained={path.parent},gguf_file={path.name},tokenizer={tokenizer_dir},"
                                   "dtype=float32")
    assert abs(ours - theirs) <= 0.01, (ours, theirs)
    assert 0.3 < ours  # the model knows some answers: the scores are not noise
    for mine, ref in zip(our_scores, their_scores):
        assert max(abs(a - b) for a, b in zip(mine, ref)) < 1e-3, (mine, ref)
