"""FSDP / verl per-rank checkpoints: the reader (:mod:`.reader`), a rank file's DTensor entries
(:mod:`.entries`), the stand-in classes its pickle may build (:mod:`.classes`) and the pieces (:mod:`.pieces`)."""
