"""Language models: configs, loaders, tokenizers, architectures, the generator and the CLI."""
