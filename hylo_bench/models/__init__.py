"""Model code: config, MLA, Gated DeltaNet, hybrid model, caches, checkpoint I/O."""
