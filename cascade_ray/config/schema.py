"""The typed, strict configuration schema: every knob is documented once, here, on its field.

Unknown keys and wrong types are errors (``extra="forbid"``, ``strict=True``); the
loader (:mod:`cascade_ray.config.loader`) turns pydantic's errors into messages with
the key path and a did-you-mean. Cross-field rules live in :mod:`cascade_ray.config.checks`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

STAGE_NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"


class _Strict(BaseModel):
    """Base of every section: no unknown keys, no silent type coercion ("1" is not 1)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class DataConfig(_Strict):
    """Where the training data comes from and how it is split."""

    source: Literal["digits", "fashion_mnist", "parquet"] = Field(
        "fashion_mnist",
        description="Dataset: `fashion_mnist` (Debian's dataset-fashion-mnist files), "
        "`digits` (scikit-learn's bundled 8x8 digits, for fast tests) or `parquet`.",
    )
    root: str = Field(
        "/usr/share/datasets/fashion-mnist",
        description="Folder holding the Fashion-MNIST idx files (source: fashion_mnist).",
    )
    path: str | None = Field(
        None, description="Parquet file, folder or glob with the training rows (source: parquet)."
    )
    test_path: str | None = Field(
        None, description="Parquet file, folder or glob with the test rows (source: parquet)."
    )
    image_column: str = Field("image", description="Parquet column holding the images.")
    label_column: str = Field("label", description="Parquet column holding integer labels.")
    image_shape: list[int] | None = Field(
        None,
        min_length=3,
        max_length=3,
        description="(C, H, W) of a flat parquet image column; inferred when stored in the file.",
    )
    train_size: int | None = Field(
        None,
        gt=0,
        description="Stratified, seeded subset of the training split to use; null means all.",
    )
    val_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="Fraction of the training subset held out for validation."
    )


class ModelConfig(_Strict):
    """A stage module: `type` names a builtin or `package.module:Callable`; other keys are its kwargs."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    type: str = Field(
        description="Builtin model (`resnet`, `transformer`, `mlp`) or `package.module:Callable` "
        "returning an nn.Module. Every other key in this section is passed to it as a keyword."
    )

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments for the model factory (every key but `type`)."""
        return dict(self.model_extra or {})


class HeadConfig(_Strict):
    """The stage's own prediction head, used for the stage's loss."""

    type: Literal["linear", "none"] = Field(
        "linear",
        description="`linear`: pool the stage output and map it to the classes; `none`: the stage "
        "module already outputs class logits.",
    )
    pool: Literal["mean", "flatten"] = Field(
        "mean",
        description="How a 3-D/4-D stage output is reduced to one vector per sample before the "
        "linear layer: mean over tokens / spatial positions, or flatten.",
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout before the linear layer.")


class AdapterConfig(_Strict):
    """A learned projection from the upstream output width to this stage's input width."""

    type: Literal["linear"] = Field(
        "linear",
        description="`linear`: a 1x1 convolution for feature maps, a Linear layer for tokens/vectors.",
    )


class LossConfig(_Strict):
    """The stage's loss and its weight."""

    type: Literal["cross_entropy"] = Field("cross_entropy", description="Loss function.")
    scale: float = Field(
        1.0,
        gt=0.0,
        description="Multiplier on this stage's loss; in a joint stage, this stage's weight in "
        "the summed loss.",
    )
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0, description="Cross-entropy label smoothing.")
    weighting: Literal["static", "uncertainty"] = Field(
        "static",
        description="Joint stages only: `static` sums `scale_i * loss_i`; `uncertainty` learns one "
        "log-variance per term (Kendall et al. 2018) on top of the scales.",
    )


class SchedulerConfig(_Strict):
    """Learning-rate schedule, stepped once per optimizer step (never per micro-batch)."""

    type: Literal["constant", "cosine"] = Field(
        "constant", description="`constant`, or `cosine` decay from lr to lr * min_lr_ratio over the stage."
    )
    warmup_steps: int = Field(
        0, ge=0, description="Optimizer steps of linear warmup from ~0 to lr before the schedule."
    )
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Final lr of `cosine`, as a fraction of lr.")


class SolverConfig(_Strict):
    """The stage's optimizer. Arguments the optimizer does not take are errors, not ignored."""

    type: str = Field(
        "AdamW",
        description="A torch.optim optimizer by its exact class name (SGD, Adam, AdamW, RAdam, ...).",
    )
    lr: float = Field(1e-3, gt=0.0, description="Learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="Weight decay (decoupled for AdamW).")
    betas: list[float] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description="Two floats in [0, 1) for Adam-family optimizers; null uses torch's default.",
    )
    momentum: float | None = Field(
        None, ge=0.0, lt=1.0, description="Momentum for SGD/RMSprop; null uses torch's default."
    )
    lr_scheduler: SchedulerConfig = Field(
        default_factory=SchedulerConfig,
        description="The lr schedule; its length is the stage's total optimizer steps.",
    )


class AugmentConfig(_Strict):
    """Random augmentation of training batches (never of validation or test data)."""

    hflip: bool = Field(False, description="Flip each training image left-right with probability 0.5.")
    crop_padding: int = Field(
        0, ge=0, description="Zero-pad by this many pixels, then crop back at a random offset per image."
    )

    @property
    def enabled(self) -> bool:
        """True when any augmentation is on."""
        return self.hflip or self.crop_padding > 0


class TrainConfig(_Strict):
    """How long and how the stage trains."""

    epochs: int = Field(1, ge=1, description="Passes over the training split.")
    max_steps: int | None = Field(
        None, ge=1, description="Stop after this many optimizer steps even if epochs remain."
    )
    batch_size: int = Field(128, ge=1, description="Samples per optimizer step per worker.")
    eval_batch_size: int = Field(512, ge=1, description="Samples per validation batch per worker.")
    log_interval: int = Field(
        50, ge=1, description="Print a progress line every this many optimizer steps (rank 0)."
    )
    augment: AugmentConfig = Field(
        default_factory=AugmentConfig, description="Random augmentation of this stage's training batches."
    )
    metric: Literal["val_accuracy", "val_loss"] = Field(
        "val_accuracy", description="Metric that selects the best checkpoint."
    )


class ScalingConfig(_Strict):
    """Ray Train scaling for this stage's TorchTrainer."""

    num_workers: int = Field(1, ge=1, description="Training worker processes (DDP ranks).")
    use_gpu: bool = Field(False, description="One GPU per worker, NCCL backend (gloo on CPU).")
    resources_per_worker: dict[str, float] | None = Field(
        None,
        description='Ray resources per worker, e.g. {"CPU": 2}; null lets Ray default to 1 CPU. '
        "Torch threads per worker follow the CPU count.",
    )


class StageConfig(_Strict):
    """One stage: its own module, head, loss, solver, training schedule and scaling."""

    name: str = Field(pattern=STAGE_NAME_PATTERN, description="Unique stage name.")
    type: Literal["module", "joint"] = Field(
        "module",
        description="`module` adds and trains a new module on top of the frozen upstream; `joint` "
        "adds nothing and trains the composed model on the weighted sum of every stage's loss.",
    )
    model: ModelConfig | None = Field(None, description="The stage's module (type: module only).")
    pretrained: str | None = Field(
        None,
        description="Optional state-dict file (.safetensors, or .pt loaded with weights_only) "
        "loaded into this stage's module before training.",
    )
    adapter: AdapterConfig | None = Field(
        None,
        description="Insert a learned projection when the upstream output width differs from "
        "this module's input width (otherwise a mismatch is an error).",
    )
    trainable_layers: dict[str, int] = Field(
        default_factory=dict,
        description="Upstream stage name -> number of its last layers to unfreeze and train with "
        "this stage's solver (-1 = all). Those layers leave the frozen digest.",
    )
    head: HeadConfig = Field(default_factory=HeadConfig, description="The stage's head.")
    loss: LossConfig = Field(default_factory=LossConfig, description="The stage's loss.")
    solver: SolverConfig = Field(default_factory=SolverConfig, description="The stage's optimizer.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The stage's schedule.")
    scaling: ScalingConfig = Field(
        default_factory=ScalingConfig, description="The stage's Ray Train scaling."
    )


class PipelineConfig(_Strict):
    """A whole cascade: data, and the stages in the order they train."""

    name: str = Field(pattern=STAGE_NAME_PATTERN, description="Run name; artifacts go to storage_path/name.")
    seed: int = Field(0, description="Seed for data splits, initialization and shuffling.")
    storage_path: str = Field(
        "~/cascade-ray-runs",
        description="Where artifacts, Ray Train runs and summary.json go. Use an absolute path: Ray "
        "workers and jobs run in other working directories.",
    )
    data: DataConfig = Field(default_factory=DataConfig, description="The data section.")
    stages: list[StageConfig] = Field(min_length=1, description="Stages, in training order.")

    def stage_index(self, name: str) -> int:
        """Index of the stage called `name` (KeyError when absent)."""
        for i, stage in enumerate(self.stages):
            if stage.name == name:
                return i
        raise KeyError(name)
