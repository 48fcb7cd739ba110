"""Worker side: model, attention backends, loader, model runner, sampler."""
