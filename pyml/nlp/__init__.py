"""Language models: configs, loaders, tokenizers, architectures, the sampler, the generator and
load_model (api.py), the one place a model is built from a file."""
