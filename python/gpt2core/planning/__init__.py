"""What a run will cost before it starts: the memory plan (memplan: bytes per GPU by part, allocating nothing), the
largest micro-batch that fits (batchfit) and the GPUs' peak FLOP rates (perf)."""
