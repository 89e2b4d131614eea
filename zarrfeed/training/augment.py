"""The augmentation a training run declares (``data.augment`` in its YAML, or Python), and
the object that applies it to batches on their device.

A recipe gives every operation's default; the fields given for an operation replace the
recipe's (an operation the recipe lacks starts from its own defaults), ``null`` turns it off::

    data:
      augment:
        recipe: ct            # ct | image | spike | none
        noise: {p: 0.2, std: [0.0, 0.05]}
        elastic: {p: 0.1, magnitude: 3.0}
        gamma: null

The operations are declared once, in :mod:`zarrfeed.transforms.augment.ops`
(``Operations``): the config's field for each, with its type, default and description,
comes from there.  The engine (pure torch, any device) is :mod:`zarrfeed.transforms.augment`.
Reading the declaration imports no torch, so the training config can hold it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields, is_dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from zarrfeed.transforms.augment.ops import OPERATIONS, Operations, Role

if TYPE_CHECKING:
    import torch

    from zarrfeed.transforms.augment.pipeline import Pipeline

NONE: dict[str, Any] = {"keys": {"image": "image"}}  # the recipe "none": no operation


def recipes() -> dict[str, Mapping[str, Any]]:
    """Recipe name -> its operations' defaults: ``none`` and every recipe a registered
    family declares (``Family.augment``); a name two families declare is an error."""
    from zarrfeed.families.registry import families

    found: dict[str, Mapping[str, Any]] = {"none": NONE}
    where = {"none": "zarrfeed"}
    for family in families():
        for name, recipe in family.augment.items():
            if name in found:
                raise ValueError(f"augment recipe {name!r}: declared by {where[name]} and "
                                 f"{family.name}")  # fmt: skip
            found[name], where[name] = recipe, family.name
    return found


class AugmentSettings(BaseModel):
    """What an augmentation declares besides its operations (the recipe and the roles of
    the batch keys), and what is done with a whole declaration: :class:`AugmentConfig`
    adds one field per operation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    recipe: str = Field(
        "none",
        description="the defaults every operation not given here takes: none, or a recipe a "
        "family declares (ct, image, spike); a task's data section defaults to its own",
    )
    keys: dict[str, Role] = Field(
        default_factory=dict,
        description="batch key -> role: image (resampled, intensity operations), target "
        "(resampled only), mask (nearest voxel, dtype kept); default: the recipe's",
    )

    @model_validator(mode="before")
    @classmethod
    def _recipe_defaults(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        known = recipes()
        recipe = known.get(data.get("recipe", "none"))
        if recipe is None:
            raise ValueError(f"recipe: expected one of {sorted(known)}, got {data['recipe']!r}")
        merged = dict(recipe)
        for name, value in data.items():
            base = recipe.get(name)
            if is_dataclass(base) and isinstance(value, Mapping):
                value = {**asdict(base), **value}  # the fields given replace the recipe's
            merged[name] = value
        return merged

    def pipeline(self) -> Pipeline:
        """The engine for this declaration (loads torch)."""
        from zarrfeed.transforms.augment.pipeline import Pipeline

        return Pipeline(**{f.name: getattr(self, f.name) for f in fields(Pipeline)})

    def describe(self) -> str:
        """One line for the loader's log: the recipe and the operations on."""
        on = [f"{n}(p={getattr(self, n).p:g})" for n in OPERATIONS if getattr(self, n)]
        return f"augment: recipe {self.recipe}, {', '.join(on) or 'no operations'}"


def operation_fields() -> dict[str, Any]:
    """A config field for each operation :class:`Operations` declares: its type and default
    (None: off), described by the operation's docstring."""
    hints = get_type_hints(Operations)
    found = {}
    for f in fields(Operations):
        (op,) = (t for t in get_args(hints[f.name]) if t is not type(None))
        summary = " ".join((op.__doc__ or "").split("\n\n")[0].split())
        found[f.name] = (hints[f.name], Field(f.default, description=summary))
    return found


AugmentConfig = create_model(
    "AugmentConfig",
    __base__=AugmentSettings,
    __module__=__name__,
    __doc__="Batched, seeded augmentation on the training device (``data.augment``).",
    **operation_fields(),
    padding=(
        Literal["zeros", "border", "reflection"],
        Field("border", description="what images are resampled with outside the field of view"),
    ),
    spatial_dims=(
        Literal[2, 3] | None,
        Field(
            None,
            description="trailing spatial axes (axes between the batch axis and them are "
            "channels); default: every axis after (N, C)",
        ),
    ),
)


class Augment:
    """Applies an :class:`AugmentConfig` to batch dicts on whatever device they are on.

    ``apply(batch, seed, epoch, indices)`` draws each sample's parameters from (seed,
    epoch, its dataset index) only: the same batch from the device tier or from the
    DataLoader (one sample at a time on the host) comes out equal within float tolerance.
    """

    def __init__(self, config: AugmentConfig | Mapping[str, Any] | None = None) -> None:
        if config is None:
            config = AugmentConfig()
        elif not isinstance(config, AugmentConfig):
            config = AugmentConfig.model_validate(config)
        self.config = config
        self.pipeline = config.pipeline()

    def apply(
        self,
        batch: Mapping[str, Any],
        seed: int,
        epoch: int,
        indices: Sequence[int] | Any,
    ) -> dict[str, Any]:
        """A new batch dict with the declared keys augmented (other keys passed through)."""
        return self.pipeline.apply(batch, seed, epoch, indices)

    def apply_sample(
        self, sample: Mapping[str, Any], seed: int, epoch: int, index: int
    ) -> dict[str, Any]:
        """One sample without the batch axis, augmented as in any batch (the host path)."""
        return self.pipeline.apply_sample(sample, seed, epoch, index)

    def scratch_bytes(
        self, shapes: Mapping[str, Sequence[int]], dtypes: Mapping[str, torch.dtype]
    ) -> int:
        """Peak device bytes one :meth:`apply` allocates beyond its inputs for batches of
        these per-key shapes and dtypes: what a device memory budget must leave free."""
        return self.pipeline.scratch_bytes(shapes, dtypes)

    def batch_scratch(self, sample: Mapping[str, Any], batch_size: int) -> int:
        """:meth:`scratch_bytes` for batches of ``batch_size`` samples like ``sample`` (one
        sample before augmentation, its declared keys without the batch axis)."""
        missing = [k for k in self.pipeline.keys if k not in sample]
        if missing:
            raise KeyError(
                f"augment: the samples have no {missing} (they have {sorted(sample)}); "
                f"declared keys: {dict(self.pipeline.keys)}"
            )
        keys = self.pipeline.keys
        shapes = {k: (batch_size, *sample[k].shape) for k in keys}
        return self.scratch_bytes(shapes, {k: sample[k].dtype for k in keys})
