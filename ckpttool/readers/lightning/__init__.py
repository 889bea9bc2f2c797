"""PyTorch Lightning checkpoints: the reader (:mod:`.reader`) and the classes a checkpoint's pickles may name, by
Lightning release (:mod:`.classes`)."""
