"""Layouts: what a source holds, as plain frozen data built without reading any tensor.

- :mod:`.layout`: :class:`~.layout.Layout`, its tensors, their pieces and the boxes of the global tensor each holds.
- :mod:`.builder`: the one way a reader builds a layout.
- :mod:`.regions`: box arithmetic, where a region of one box lands in another.
- :mod:`.placements`: DTensor placement arithmetic, which regions of a global tensor a rank of a mesh holds.

Format-blind and family-blind: readers build layouts, plans consume them.
"""
