"""pyml-batch: generate for every prompt of a JSONL file, in one process or on Ray's workers.

    pyml-batch prompts.jsonl --out replies.jsonl -m smollm2-135m -n 64
    pyml-batch prompts.jsonl --out replies.jsonl --ray --workers 2          # a local Ray instance
    pyml-batch prompts.jsonl --out replies.jsonl --ray --address HOST:6379  # a Ray cluster

Each input line is {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]}, optionally
with its own sampling fields (batch_jobs.OVERRIDES); each output line {"id", "text", "tokens",
"stop_reason", "timings"}, in input order, or {"id", "line", "error"} for a line that could not
run. Rerunning with the same --out skips the ids already done there. docs/scaling.md.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext

from pyml.cli.batch_jobs import (OrderedWriter, failed, id_key, output_tokens, read_jobs, resume, run_job,
                                 run_jobs_batched)
from pyml.cli.main import Parser, run_command, say
from pyml.cli.options import (add_model_options, add_sampling_options, add_speculative_options, check_ray_only,
                              check_speculative, model_options, profiling, sampling_options, speculative_options)
from pyml.core import perf, progress
from pyml.core.errors import PymlError
from pyml.nlp.api import load_model


def build_parser() -> Parser:
    p = Parser(prog="pyml-batch", description="Generate for every prompt of a JSONL file, in input order, "
               "resumably; on Ray's workers with --ray.")
    p.add_argument("input", metavar="IN.jsonl", help='one {"id": ..., "prompt": ...} or {"id": ..., '
                   '"messages": [...]} per line, with optional per-line sampling fields')
    p.add_argument("--out", metavar="OUT.jsonl", required=True,
                   help="where the replies go (appended; the ids already there are skipped)")
    add_model_options(p)
    p.add_argument("--chat", action="store_true", help="wrap every prompt in the model's chat template")
    add_sampling_options(p, max_tokens=64)
    p.add_argument("--batch", type=int, default=1, metavar="N",
                   help="sequences generated together, one model pass a step (default 1: one prompt at a time); "
                        "a prompt joins as another ends, the texts are those of one at a time")
    p.add_argument("--ray", action="store_true", help='run on Ray workers (needs pip install "pyml[ray]")')
    p.add_argument("--workers", type=int, default=None, help="with --ray: Ray workers, each with its own model and -t "
                   "threads (default 2 workers; -t defaults to the cores shared out among them)")
    p.add_argument("--address", default=None,
                   help="with --ray: a Ray cluster's address (default: RAY_ADDRESS, else a local instance)")
    add_speculative_options(p)
    p.add_argument("--log", metavar="LEVEL", default=None, help="log level or filters (as pyml-infer's)")
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="record every worker's perf events into DIR and write one report over all of them")
    return p


class Tally:
    """The progress bar (prompts, with tokens/s) and the closing summary's figures."""

    def __init__(self, total: int):
        self.bar = progress.bar(total=total, desc="pyml-batch", unit="prompt")
        self.t0 = self.created = perf.clock()
        self.prompts = self.errors = self.tokens = 0

    def start(self) -> None:
        """The model is loaded (everywhere): tokens/s counts from here."""
        self.t0 = perf.clock()

    def add(self, out: dict) -> None:
        self.prompts += 1
        self.errors += failed(out)
        self.tokens += output_tokens(out)
        self.bar.set_postfix_str(f"{self.tok_s:.1f} tok/s", refresh=False)
        self.bar.update(1)

    @property
    def tok_s(self) -> float:
        elapsed = perf.clock() - self.t0
        return self.tokens / elapsed if elapsed > 0 else 0.0

    def summary(self, skipped: int, where: str) -> str:
        self.bar.close()
        return (f"pyml-batch: {self.prompts - self.errors} prompts done, {self.errors} errors"
                f"{f', {skipped} already done' if skipped else ''} | {self.tokens} tokens in "
                f"{perf.clock() - self.t0:.1f} s ({self.tok_s:.1f} tok/s) after {self.t0 - self.created:.1f} s "
                f"of start-up | {where}")


def run(args) -> int:
    perf.configure(args.log)
    check_ray_only(args, "workers", "address")
    args.workers = 2 if args.workers is None else args.workers
    if args.workers < 1:
        raise PymlError(f"--workers must be at least 1, got {args.workers}")
    if args.batch < 1:
        raise PymlError(f"--batch must be at least 1, got {args.batch}")
    check_speculative(args)
    if (args.lookup_ngram or args.draft_model is not None) and args.ray:
        raise PymlError("speculative decoding with --ray is not implemented: it drafts in this process "
                        "(--batch N, no --ray)")
    if args.draft_model is not None and args.batch > 1:
        raise PymlError("--draft-model with --batch N > 1 is not implemented: a draft model drafts for one "
                        "sequence at a time (--batch 1), prompt lookup (--lookup-ngram) for a batch")
    jobs, errors = read_jobs(args.input, sampling_options(args), args.chat, args.system)
    # Ray is reached (or found missing) before the output file is touched
    with _ray_runner().session(args.address) if args.ray else nullcontext():
        return _batch(args, jobs, errors)


def _batch(args, jobs: list, errors: list) -> int:
    done = resume(args.out)
    todo = [j for j in jobs if id_key(j.id) not in done]
    writer = OrderedWriter(args.out, sorted([j.line for j in todo] + [line for line, _ in errors]))
    tally = Tally(len(todo) + len(errors))
    ctx = profiling(args.profile)
    with writer, ctx as prof:
        for line, out in errors:
            writer.add(line, out)
            tally.add(out)
        if todo:
            where = (_run_on_ray(args, todo, writer, tally, prof) if args.ray
                     else _run_here(args, todo, writer, tally, prof))
        else:
            where = "nothing to run"
    say(tally.summary(len(jobs) - len(todo), where))
    if prof is not None:
        say(f"pyml-batch: profile in {args.profile}: " + ", ".join(p.name for p in prof.written))
    return 1 if tally.errors else 0  # every line is written either way; a script learns that some failed


def _run_here(args, jobs, writer, tally, prof) -> str:
    lm = load_model(**model_options(args))
    if prof is not None:
        prof.set_model(lm)
    tally.start()
    speculative = speculative_options(args, lm)
    outputs = (((job, run_job(lm, job, speculative)) for job in jobs) if args.batch == 1 else
               run_jobs_batched(lm, jobs, args.batch, speculative))
    for job, out in outputs:
        writer.add(job.line, out)
        tally.add(out)
    at_once = min(args.batch, len(jobs))  # a step holds no more sequences than there are prompts
    batched = f", {at_once} sequences a step" if at_once > 1 else ""
    return f"1 process, {lm.runtime.threads} threads{batched}"


def _run_on_ray(args, jobs, writer, tally, prof) -> str:
    ray_runner = _ray_runner()
    pool = None
    try:
        threads = args.threads or ray_runner.default_threads(args.workers)
        pool = ray_runner.WorkerPool(args.workers, threads, model_options(args), profile=prof is not None,
                                     batch=args.batch)
        infos = pool.start()
        here = ray_runner.wall_offset()
        if prof is not None:
            prof.info.update(model=infos[0]["model"], threads=threads, load_s=max(i["load_s"] for i in infos),
                             workers=[{k: v for k, v in i.items() if k not in ("records", "model")} for i in infos])
            for w, info in enumerate(infos, 1):
                prof.add_records(info["records"], w, info["clock"] - here)
        tally.start()
        for w, job, reply in pool.run(jobs):
            out = reply["out"]
            writer.add(job.line, out)
            tally.add(out)
            if prof is not None and reply.get("records"):
                prof.add_records(reply["records"], w + 1, reply["clock"] - here)
        nodes = len({i["node"] for i in infos})
        batched = f", {args.batch} sequences a step each" if args.batch > 1 else ""
        return (f"Ray: {args.workers} workers x {threads} threads on {nodes} node{'s' if nodes > 1 else ''}"
                f"{batched} ({', '.join(str(n) for n in pool.done)} prompts each)")
    finally:
        if pool is not None:
            pool.close()


def _ray_runner():
    # Deferred: `import ray` costs ~1.0 s, and only --ray needs it.
    from pyml.cli import ray_runner
    return ray_runner



def main(argv=None) -> int:
    return run_command("pyml-batch", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
