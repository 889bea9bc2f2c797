"""A config's sizes checked against what the checkpoint holds, before transformers builds a model from it.

transformers builds a model layer by layer (about 2 ms a layer on the meta device) and names ``save_pretrained``'s
tensors expert by expert (about 50 us each), so a config of 200000 layers or a million experts takes minutes
before any comparison can say that it does not fit the checkpoint. A config small enough to build in a second or
two is built at once. A larger one is compared with the checkpoint first (its layout, read without the model):

- a checkpoint holds at least one tensor per layer, so ``num_hidden_layers`` (and the other names of the layer
  count, also in a nested ``text_config``) may not exceed its tensor count;
- it holds at least one tensor per routed expert, or one tensor with a dim of the expert count (stacked
  experts), so ``num_local_experts`` (and the other names) may not exceed the larger of its tensor count and its
  largest dim.

DeepSeek-V3 (61 layers, 256 experts, about 91000 tensors) passes by far. Where the checkpoint cannot be counted
without the model (transformers distributed checkpoints record no global shapes), absolute ceilings apply, far
above any released model: :data:`MAX_LAYERS` layers and :data:`MAX_EXPERT_SLOTS` layers x (experts + 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from ckpttool.layout.layout import Layout
from ckpttool.errors import ConfigError

#: config keys that give the number of layers, and the number of routed experts
LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers")
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
#: configs at most this large are built without counting the checkpoint first (a second or two)
CHEAP_LAYERS, CHEAP_EXPERT_SLOTS = 512, 65_536
#: ceilings where the checkpoint cannot be counted without the model
MAX_LAYERS, MAX_EXPERT_SLOTS = 2048, 262_144


@dataclass(frozen=True, slots=True)
class Census:
    """What a checkpoint holds, as far as a config's sizes can be checked: its tensors and its largest dim."""

    tensors: int
    largest_dim: int

    @classmethod
    def of(cls, layout: Layout) -> Census:
        """The census of a layout (counting a checkpoint on disk is :func:`ckpttool.readers.census`)."""
        dims = (d for t in layout.tensors.values() for d in t.global_shape)
        return cls(len(layout.tensors), max(dims, default=0))


def check_config_sizes(config: Mapping[str, object], label: str, count: Callable[[], Census | None]) -> None:
    """Refuse ``config`` when its layer or expert counts are absurd for the checkpoint ``count()`` describes.

    ``count`` is called only for a config too large to build at once (a real checkpoint is not read twice).

    Raises:
        ConfigError: the config names more layers or experts than the checkpoint can hold.

    Example:
        >>> check_config_sizes({"num_hidden_layers": 200000}, "config.json", lambda: Census(21, 1001))
        Traceback (most recent call last):
        ...
        ckpttool.errors.ConfigError: 'config.json': num_hidden_layers 200000, but the checkpoint holds 21 tensors, and every layer has at least one; is it the config of another model?
    """
    layers = max((v for _, v in _values(config, LAYER_KEYS)), default=0)
    experts = max((v for _, v in _values(config, EXPERT_KEYS)), default=0)
    if layers <= CHEAP_LAYERS and max(layers, 1) * (experts + 1) <= CHEAP_EXPERT_SLOTS:
        return
    held = count()
    for key, value in _values(config, LAYER_KEYS):
        if held is not None and value > held.tensors:
            raise ConfigError(
                f"'{label}': {key} {value}, but the checkpoint holds {held.tensors} tensors, and every layer has at "
                "least one; is it the config of another model?"
            )
        if held is None and value > MAX_LAYERS:
            raise ConfigError(f"'{label}': {key} {value} is more than any model has (ckpttool takes at most "
                              f"{MAX_LAYERS}); is the config damaged?")
    for key, value in _values(config, EXPERT_KEYS):
        if held is not None and value > max(held.tensors, held.largest_dim):
            raise ConfigError(
                f"'{label}': {key} {value}, but the checkpoint holds {held.tensors} tensors and none has a dim that "
                "large (every expert has a tensor of its own or a row of a stacked one); is it the config of another "
                "model?"
            )
        if held is None and max(layers, 1) * (value + 1) > MAX_EXPERT_SLOTS:
            raise ConfigError(f"'{label}': {key} {value} over {layers} layers is more than any model has (ckpttool "
                              f"takes at most {MAX_EXPERT_SLOTS} layers x experts); is the config damaged?")


def _values(config: Mapping[str, object], keys: tuple[str, ...]) -> Iterator[tuple[str, int]]:
    """``(key, value)`` of each integer ``keys`` entry of ``config`` and of its nested configs (``text_config``)."""
    for scope in (config, *(v for v in config.values() if isinstance(v, Mapping))):
        for key in keys:
            value = scope.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                yield key, value
