"""rayspec on Ray against torch.distributed.pipelining on the same 2-stage split."""
