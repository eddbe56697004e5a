"""The continuous-batching engine: model, sampler, scheduler, beam search, weight loaders."""
