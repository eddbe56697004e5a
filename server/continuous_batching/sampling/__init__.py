"""The token choice on the device: logits processing, draws, logprobs and beam candidates."""
