"""The typed, strict configuration schema: every knob is documented once, here, on its field.

Unknown keys and wrong types are errors (``extra="forbid"``, ``strict=True``); the
loader (:mod:`cascade_ray.config.loader`) turns pydantic's errors into messages with
the key path and a did-you-mean. Cross-field rules live in :mod:`cascade_ray.checks.semantic`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from cascade_ray.text import short_repr

STAGE_NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"
# Upper bounds past which a value is certainly a mistake (a typo'd exponent, a byte count for a
# sample count), not a big job: each is an error naming the key and the bound.
MAX_EPOCHS = 100_000
MAX_OPTIMIZER_STEPS = 10**9
MAX_BATCH_SIZE = 2**20
MAX_ACCUMULATION_STEPS = 2**16
MAX_WORKERS = 4096
MAX_CLASSES = 2**24


class _Strict(BaseModel):
    """Base of every section: no unknown keys, no silent type coercion ("1" is not 1)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


TargetKind = Literal["class", "multilabel", "regression"]
# data.image_column / label_column / image_shape: the image-case spellings of data.inputs / data.target
_DATA_ALIASES = {
    "image_column": ("inputs", "column"),
    "image_shape": ("inputs", "shape"),
    "label_column": ("target", "column"),
}


class InputsConfig(_Strict):
    """The model input: one column, one tensor per row."""

    column: str = Field("image", description="Parquet column holding each row's input tensor.")
    shape: list[int] | None = Field(
        None,
        min_length=1,
        max_length=3,
        description="Per-row shape: `[C, H, W]` images, `[T, D]` sequences, `[D]` feature vectors. "
        "Inferred from the file (an Arrow tensor type, or the `cascade_ray.image_shape` metadata "
        "`write_parquet` stores); a flat list column without either is a `[D]` vector. Set it to "
        "reshape a flat column (e.g. `[1, 28, 28]` for 784 pixels).",
    )

    @field_validator("shape")
    @classmethod
    def _positive(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(d <= 0 for d in value):
            raise ValueError(f"every dimension must be > 0, got {value}")
        return value


class TargetConfig(_Strict):
    """What the model predicts, and from which column."""

    column: str = Field("label", description="Parquet column holding each row's target.")
    kind: TargetKind = Field(
        "class",
        description="`class`: one integer class index per row (softmax over `num_classes`); "
        "`multilabel`: a list of `num_classes` 0/1 flags per row (one sigmoid each); "
        "`regression`: a number, or a list of `dim` numbers, per row.",
    )
    num_classes: int | None = Field(
        None, ge=2, le=MAX_CLASSES, description="Classes (class, multilabel); null infers them from the data."
    )
    dim: int | None = Field(None, ge=1, description="Regression: values per row; null infers them (1 for a scalar).")


class NormalizeStats(_Strict):
    """Explicit normalization: `(x - mean) / std`, per channel (images) or per feature."""

    mean: list[float] = Field(min_length=1, description="One value per channel / feature, or one for all.")
    std: list[float] = Field(min_length=1, description="One value per channel / feature, or one for all; each > 0.")

    @field_validator("std")
    @classmethod
    def _positive(cls, value: list[float]) -> list[float]:
        if any(not v > 0 for v in value):
            raise ValueError(f"every std must be > 0, got {value}")
        return value


class DataConfig(_Strict):
    """Where the training data comes from, what it holds and how it is split."""

    source: Literal["digits", "fashion_mnist", "parquet"] = Field(
        "fashion_mnist",
        description="Dataset: `fashion_mnist` (Debian's dataset-fashion-mnist files), "
        "`digits` (scikit-learn's bundled 8x8 digits, for fast tests) or `parquet`.",
    )
    root: str = Field(
        "/usr/share/datasets/fashion-mnist",
        description="Folder holding the Fashion-MNIST idx files (source: fashion_mnist).",
    )
    path: str | None = Field(None, description="Parquet file, folder or glob with the training rows (source: parquet).")
    test_path: str | None = Field(
        None, description="Parquet file, folder or glob with the test rows (source: parquet)."
    )
    inputs: InputsConfig = Field(default_factory=InputsConfig, description="The input column and its per-row shape.")
    target: TargetConfig = Field(default_factory=TargetConfig, description="The target column and its kind.")
    normalize: Literal["auto", "none"] | NormalizeStats = Field(
        "auto",
        description="`auto`: per-channel (images) or per-feature (vectors, sequences) mean/std of the "
        "training split; `none`: raw values; `{mean: [...], std: [...]}`: the statistics a pretrained "
        "stage expects. The values used are written to every stage manifest.",
    )
    streaming: bool | Literal["auto"] = Field(
        False,
        description="Parquet only. `true`: stream the data through Ray Data (`read_parquet`, one shard per "
        "worker, reshuffled every epoch) instead of loading it into the driver; the validation rows are a "
        "seeded content-hash share of data.path (not stratified) and the statistics come from one scan. "
        "`auto`: stream when the training inputs would take more than 30% of the object store.",
    )
    streaming_cpus: float = Field(
        1.0,
        gt=0.0,
        description="Streaming: CPUs kept free of training workers for Ray Data's read tasks (Ray Train "
        "reserves its CPUs first; with none left, streaming waits forever).",
    )
    train_size: int | None = Field(
        None,
        gt=0,
        description="Seeded subset of the training split to use (stratified for class targets); null means all "
        "(not with streaming).",
    )
    val_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="Fraction of the training subset held out for validation."
    )

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, value: Any) -> Any:
        """`image_column` / `image_shape` / `label_column` are accepted spellings of
        `inputs.column` / `inputs.shape` / `target.column`; giving both is an error."""
        if not isinstance(value, dict) or not any(k in value for k in _DATA_ALIASES):
            return value
        value = dict(value)
        for alias, (section, key) in _DATA_ALIASES.items():
            if alias not in value:
                continue
            given = value.pop(alias)
            part = dict(value.get(section) or {})
            if key in part and part[key] != given:
                raise ValueError(
                    f"data.{alias} ({short_repr(given)}) and data.{section}.{key} ({short_repr(part[key])}) disagree; keep data.{section}.{key}"
                )
            part[key] = given
            value[section] = part
        return value


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

    type: str = Field(
        "auto",
        description="`auto`: the loss of data.target.kind (class: cross_entropy, multilabel: bce, regression: "
        "mse); `cross_entropy` (class targets), `bce` (multilabel: one sigmoid per class), `mse` or "
        "`huber` (regression), or `package.module:Callable` returning a loss module called as "
        "`loss(outputs, targets)` (checked on the meta device before Ray starts).",
    )
    scale: float = Field(
        1.0,
        gt=0.0,
        description="Multiplier on this stage's loss; in a joint stage, this stage's weight in the summed loss.",
    )
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0, description="Cross-entropy label smoothing.")
    huber_delta: float = Field(1.0, gt=0.0, description="`huber`: where the loss turns from quadratic to linear.")
    weighting: Literal["static", "uncertainty"] = Field(
        "static",
        description="Joint stages only: `static` sums `scale_i * loss_i`; `uncertainty` learns one "
        "log-variance per term (Kendall et al. 2018) on top of the scales.",
    )
    weights: dict[str, float] | None = Field(
        None,
        description="Joint stages only: stage name -> weight of that stage's loss term, replacing its "
        "`loss.scale` in the sum (so a sweep can tune the weights without touching the upstream "
        "stages' own configs); stages not listed keep their `loss.scale`.",
    )


def _auto(value: Any) -> Any:
    """``"auto"`` -> None, so a length field reads ``T_max: auto`` but stores null."""
    return None if value == "auto" else value


# A length in optimizer steps, or `auto` (stored as null): the stage's real step count.
AutoSteps = Annotated[int | None, BeforeValidator(_auto)]


class SchedulerConfig(_Strict):
    """Learning-rate schedule, stepped once per optimizer step (never per micro-batch).

    Every length is counted in optimizer steps after the warmup. A key the chosen `type`
    does not use is an error (see :func:`cascade_ray.solver.schedule.scheduler_issues`).
    """

    type: Literal[
        "constant", "StepLR", "MultiStepLR", "CosineAnnealingLR", "cosine", "OneCycleLR", "ReduceLROnPlateau"
    ] = Field(
        "constant",
        description="`constant`; torch's `StepLR`, `MultiStepLR`, `CosineAnnealingLR` (`cosine` is short "
        "for it), `OneCycleLR` (lr only; momentum is not cycled), or `ReduceLROnPlateau` (checked once "
        "per epoch on `monitor`). Any of them may follow a linear warmup.",
    )
    warmup_steps: int = Field(
        0, ge=0, description="Optimizer steps of linear warmup from ~0 up to the schedule's first lr."
    )
    T_max: AutoSteps = Field(
        "auto",
        ge=1,
        validate_default=True,
        description="CosineAnnealingLR: steps from lr down to lr * min_lr_ratio (then flat); `auto` = the "
        "stage's optimizer steps after warmup.",
    )
    min_lr_ratio: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="CosineAnnealingLR: final lr; ReduceLROnPlateau: lowest lr; as a fraction of lr.",
    )
    step_size: int | None = Field(
        None, ge=1, description="StepLR (required): multiply lr by gamma every this many steps."
    )
    milestones: list[int] | None = Field(
        None, min_length=1, description="MultiStepLR (required): increasing steps at which lr is multiplied by gamma."
    )
    gamma: float = Field(0.1, gt=0.0, le=1.0, description="StepLR, MultiStepLR: lr multiplier at each decay.")
    total_steps: AutoSteps = Field(
        "auto",
        ge=2,
        validate_default=True,
        description="OneCycleLR: length of the cycle; `auto` = the stage's optimizer steps after warmup.",
    )
    pct_start: float = Field(0.3, gt=0.0, lt=1.0, description="OneCycleLR: fraction of the cycle spent rising to lr.")
    div_factor: float = Field(25.0, ge=1.0, description="OneCycleLR: the cycle starts at lr / div_factor.")
    final_div_factor: float = Field(
        1e4, ge=1.0, description="OneCycleLR: the cycle ends at lr / (div_factor * final_div_factor)."
    )
    factor: float = Field(0.1, gt=0.0, lt=1.0, description="ReduceLROnPlateau: lr multiplier on a plateau.")
    patience: int = Field(
        2, ge=0, description="ReduceLROnPlateau: epochs without improvement of `monitor` before lr drops."
    )
    threshold: float = Field(
        1e-4, ge=0.0, description="ReduceLROnPlateau: relative change of `monitor` that counts as improvement."
    )
    monitor: str = Field(
        "val_loss",
        description="ReduceLROnPlateau: the epoch metric watched (`train_loss` or a `val_` metric of the "
        "target kind; losses and errors down, the rest up).",
    )


class ParamGroupConfig(_Strict):
    """Optimizer settings for the trainable parameters whose names match a regex."""

    match: str = Field(
        description="Regex searched in parameter names such as `blocks.features.stem.0.weight` or "
        "`heads.features.fc.bias`; the first group that matches a parameter takes it."
    )
    lr: float | None = Field(None, gt=0.0, description="This group's lr; null uses the solver's lr.")
    weight_decay: float | None = Field(None, ge=0.0, description="This group's weight decay; null uses the solver's.")
    betas: list[float] | None = Field(
        None, min_length=2, max_length=2, description="This group's betas; null uses the solver's."
    )
    momentum: float | None = Field(None, ge=0.0, lt=1.0, description="This group's momentum; null uses the solver's.")


class GradClipConfig(_Strict):
    """Gradient clipping, applied once per optimizer step (after unscaling under fp16)."""

    enabled: bool = Field(False, description="Clip gradients before every optimizer step.")
    mode: Literal["norm", "value"] = Field(
        "norm",
        description="`norm`: rescale all gradients together when their global norm (over every "
        "trainable parameter at once, not per parameter) exceeds max_norm; `value`: clamp each "
        "gradient element to [-clip_value, clip_value].",
    )
    max_norm: float = Field(1.0, gt=0.0, description="mode norm: the largest allowed global gradient norm.")
    norm_type: float = Field(2.0, gt=0.0, description="mode norm: the p of the p-norm (`.inf` for max-abs).")
    clip_value: float | None = Field(None, gt=0.0, description="mode value (required): the clamp bound.")


class ScalerConfig(_Strict):
    """fp16 loss scaling (torch.amp.GradScaler)."""

    init_scale: float = Field(65536.0, gt=0.0, description="Initial loss scale.")
    growth_interval: int = Field(2000, ge=1, description="Optimizer steps without overflow before the scale doubles.")


class SolverConfig(_Strict):
    """The stage's optimizer. Arguments the optimizer does not take are errors, not ignored."""

    type: str = Field(
        "AdamW",
        description="A torch.optim optimizer by its exact class name (SGD, Adam, AdamW, RAdam, ...).",
    )
    lr: float = Field(1e-3, gt=0.0, description="Learning rate.")
    weight_decay: float = Field(
        0.0,
        ge=0.0,
        description="Weight decay (decoupled for AdamW), applied to parameters with 2+ dimensions; biases and "
        "normalization weights get none unless decay_bias_and_norm is true.",
    )
    betas: list[float] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description="Two floats in [0, 1) for Adam-family optimizers; null uses torch's default.",
    )
    momentum: float | None = Field(
        None, ge=0.0, lt=1.0, description="Momentum for SGD/RMSprop; null uses torch's default."
    )
    decay_bias_and_norm: bool = Field(
        False, description="Also apply weight decay to 1-D parameters (biases, normalization weights)."
    )
    param_groups: list[ParamGroupConfig] = Field(
        default_factory=list,
        description="Ordered per-parameter overrides; first match wins, unmatched parameters get the "
        "settings above. A pattern that matches no trainable parameter is an error.",
    )
    lr_scheduler: SchedulerConfig = Field(
        default_factory=SchedulerConfig,
        description="The lr schedule, counted in optimizer steps.",
    )
    accumulation_steps: int = Field(
        1,
        ge=1,
        le=MAX_ACCUMULATION_STEPS,
        description="Micro-batches per optimizer step: the loss is divided by the window size, the "
        "optimizer and scheduler step once per window (the last window of an epoch may be shorter), "
        "and DDP syncs gradients only on a window's last micro-batch.",
    )
    grad_clip: GradClipConfig = Field(default_factory=GradClipConfig, description="Gradient clipping.")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="Autocast precision of forward and loss. `auto`: decided on the worker's device by what it "
        "runs natively (printed per stage, kept in the stage record and manifest): bf16 on GPUs of compute "
        "capability 8.0+ and on CPUs with AVX512-BF16 or AMX, fp16 with a GradScaler on older GPUs, fp32 "
        "otherwise (e.g. an AVX2 CPU, where bf16 is emulated and several times slower). `fp32`; `bf16` (no "
        "scaler; on hardware that emulates it see health.emulated_bf16); `fp16` (CUDA only, with a GradScaler; "
        "a skipped step does not advance the scheduler).",
    )
    scaler: ScalerConfig | None = Field(
        None,
        description="precision fp16 (or auto resolving to fp16 on a GPU) only: loss-scaler settings; null uses "
        "the defaults.",
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


class EarlyStoppingConfig(_Strict):
    """Stop a stage when an epoch metric has not improved for a while."""

    metric: str = Field(
        "val_loss", description="Epoch metric watched: `train_loss` or a `val_` metric of the target kind."
    )
    mode: Literal["min", "max"] | None = Field(
        None, description="Direction of improvement; null infers it (losses and errors: min, the rest: max)."
    )
    patience: int = Field(3, ge=1, description="Epochs without improvement before the stage stops.")
    min_delta: float = Field(0.0, ge=0.0, description="Smallest change that counts as an improvement.")


MAX_CHECKPOINTS_KEPT = 1000


class CheckpointRetention(_Strict):
    """Which of a stage's per-epoch checkpoints are kept, and which one becomes the stage artifact."""

    top_k: int = Field(
        1,
        ge=1,
        le=MAX_CHECKPOINTS_KEPT,
        description="Checkpoints kept, the best by `metric` (Ray Train's `CheckpointConfig.num_to_keep`), in the "
        "stage's Ray run folder on its storage (local or object storage); the others are deleted as training "
        "goes. The stage artifact is always the best one. At most `train.epochs`: one checkpoint per epoch.",
    )
    metric: str = Field(
        "auto",
        description="Validation metric that ranks the checkpoints and picks the artifact: `auto` is "
        "`train.metric` (resolved for the target kind), else any `val_` metric of the target kind.",
    )
    mode: Literal["auto", "min", "max"] = Field(
        "auto",
        description="Direction in which `metric` improves: `auto` follows the metric (losses and errors: min, "
        "the rest: max); an explicit value contradicting a known metric's direction is an error.",
    )
    save_last: bool = Field(
        True,
        description="Also keep the newest checkpoint when it is not among the `top_k` (the one an interrupted "
        "stage resumes from; Ray Train keeps it while the stage trains either way). `false` deletes it once "
        "the stage's artifact is written (a swept stage: in the adopted trial's run), leaving exactly the "
        "`top_k` best.",
    )
    frozen: Literal["reference", "copy"] = Field(
        "reference",
        description="What each checkpoint holds of the frozen upstream it trained on: `reference` (default) writes "
        "only the tensors the stage trains, plus the digest of every frozen one (`frozen.json`), and the stage "
        "artifact, a resume and a sweep's adoption take the frozen tensors back from the upstream artifact after "
        "checking those digests; `copy` writes the whole composed state into every checkpoint (a self-contained "
        "file, as large as the upstream).",
    )


class TrainConfig(_Strict):
    """How long and how the stage trains."""

    epochs: int = Field(
        1,
        ge=0,
        le=MAX_EPOCHS,
        description="Passes over the training split. `0` makes an import-only stage (only with "
        "`stages[i].pretrained`): the weights are loaded, frozen and written as the stage's artifact on the "
        "driver, with no Ray Train job; its record's status is `imported`.",
    )
    max_steps: int | None = Field(
        None, ge=1, le=MAX_OPTIMIZER_STEPS, description="Stop after this many optimizer steps even if epochs remain."
    )
    batch_size: int = Field(
        128,
        ge=1,
        le=MAX_BATCH_SIZE,
        description="Samples per micro-batch (one forward/backward) per worker; an optimizer step sees "
        "batch_size x solver.accumulation_steps x workers samples.",
    )
    eval_batch_size: int = Field(512, ge=1, le=MAX_BATCH_SIZE, description="Samples per validation batch per worker.")
    log_interval: int = Field(50, ge=1, description="Print a progress line every this many optimizer steps (rank 0).")
    augment: AugmentConfig = Field(
        default_factory=AugmentConfig, description="Random augmentation of this stage's training batches."
    )
    metric: str = Field(
        "auto",
        description="Validation metric that selects the best checkpoint (unless `train.checkpoint.metric` "
        "names another): `auto` (class: `val_accuracy`, "
        "multilabel: `val_map`, regression: `val_loss`) or any `val_` metric of the target kind "
        "(class: loss, accuracy, top5_accuracy with >= 10 classes; multilabel: loss, micro_f1, map; "
        "regression: loss, mae, rmse, r2).",
    )
    early_stopping: EarlyStoppingConfig | None = Field(
        None, description="Stop early on a plateau; null trains every epoch."
    )
    checkpoint: CheckpointRetention = Field(
        default_factory=CheckpointRetention,
        description="Checkpoint retention: how many per-epoch checkpoints are kept, ranked by which metric.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each block's activations in the backward pass instead of keeping them "
        "(`torch.utils.checkpoint`, non-reentrant), trading compute for memory: the blocks are the "
        "trained module's `cascade_layers()` (resnet: stem and residual blocks; transformer: embedding, "
        "each block, final norm; mlp: each Linear block; a user module must define the method). "
        "Losses and gradients are unchanged.",
    )
    sanity_val_steps: int = Field(
        2,
        ge=0,
        description="Validation batches run before training, so a broken evaluation fails in seconds "
        "rather than after the first epoch; 0 skips it.",
    )


def _off(value: Any) -> Any:
    """YAML 1.1 (PyYAML) reads a bare ``off`` as false: take it as the policy ``off``."""
    return "off" if value is False else value


Policy = Annotated[Literal["error", "warn", "off"], BeforeValidator(_off)]
_POLICY = "`error` raises HealthError, `warn` prints (rank 0) and counts, `off` (or false) skips the rule."


class HealthRule(_Strict):
    """A runtime health rule without thresholds."""

    policy: Policy = Field("error", description=_POLICY)


class StallRule(_Strict):
    """Relative update ||dtheta|| / ||theta|| of all trainable parameters too small for too long."""

    policy: Policy = Field("error", description=_POLICY)
    min_update_ratio: float = Field(1e-8, gt=0.0, description="Updates below this relative size count as stalled.")
    patience_steps: int = Field(
        50, ge=1, description="Optimizer steps of consecutive stalled measurements that fire the rule."
    )
    tail_fraction: float = Field(
        0.05,
        ge=0.0,
        lt=1.0,
        description="The last fraction of the stage's optimizer steps is exempt (a schedule annealing to ~0 stalls there on purpose).",
    )


class ClipSaturationRule(_Strict):
    """Pre-clip gradient norm far above grad_clip.max_norm for too long: clipping throttles every step."""

    policy: Policy = Field("error", description=_POLICY)
    max_ratio: float = Field(100.0, gt=1.0, description="Pre-clip norm / max_norm above this counts as saturated.")
    patience_steps: int = Field(
        50, ge=1, description="Optimizer steps of consecutive saturated measurements that fire the rule."
    )


class ScaleCollapseRule(_Strict):
    """fp16 only: the GradScaler's scale collapsed or it keeps skipping steps."""

    policy: Policy = Field("error", description=_POLICY)
    min_scale: float = Field(
        1.0, gt=0.0, description="A loss scale below this is a collapse (fp16 overflows even unscaled)."
    )
    max_skipped_steps: int = Field(
        12, ge=1, description="This many consecutive skipped (overflowed) optimizer steps fire the rule."
    )


class EmulatedBf16Rule(_Strict):
    """Explicit ``solver.precision: bf16`` on hardware that emulates bf16 (an AVX2 CPU, a GPU before Ampere)."""

    policy: Policy = Field(
        "warn",
        description="Checked when the config is validated (`cascade-ray validate`, the driver before Ray starts: "
        "against the local CPU, for stages that will run on CPU) and again in the stage on the worker's device. "
        + _POLICY
        + " `error` is a ConfigError at validate time.",
    )


class HealthConfig(_Strict):
    """Runtime health rules of a stage; each fires with its policy and names the config key to fix."""

    interval: int = Field(
        10,
        ge=1,
        description="Measure the gradient norm and relative update (and sync the non-finite checks) every "
        "this many optimizer steps; the cheaper, the larger.",
    )
    nonfinite: HealthRule = Field(default_factory=HealthRule, description="A NaN/inf loss or gradient norm.")
    grad_flow: HealthRule = Field(
        default_factory=HealthRule,
        description="A trainable parameter whose gradient is None or all zero after the first backward "
        "(confirmed at the first measurement).",
    )
    stall: StallRule = Field(default_factory=StallRule, description="Training that stopped moving.")
    clip_saturation: ClipSaturationRule = Field(
        default_factory=ClipSaturationRule, description="Clipping that throttles every step."
    )
    scale_collapse: ScaleCollapseRule = Field(
        default_factory=ScaleCollapseRule, description="fp16 loss-scale collapse."
    )
    lr_drift: HealthRule = Field(
        default_factory=HealthRule,
        description="The lr applied differs from the schedule's plan for that optimizer step (e.g. a "
        "scheduler stepped per micro-batch).",
    )
    frozen_drift: HealthRule = Field(
        default_factory=HealthRule,
        description="A frozen module in train mode at an epoch start, or a frozen parameter/buffer changed "
        "during an epoch.",
    )
    emulated_bf16: EmulatedBf16Rule = Field(
        default_factory=EmulatedBf16Rule,
        description="`solver.precision: bf16` set explicitly where bf16 is emulated, with the slowdown a probe "
        "measured there (`precision: auto` picks fp32 on such hardware instead).",
    )


class ScalingConfig(_Strict):
    """Ray Train scaling for this stage's TorchTrainer."""

    num_workers: int = Field(1, ge=1, le=MAX_WORKERS, description="Training worker processes (DDP ranks).")
    use_gpu: bool | Literal["auto"] = Field(
        "auto",
        description="`true`: one GPU per worker (NCCL backend); `false`: CPU workers (gloo); `auto`: GPUs "
        "when the cluster can give every worker of the stage one (checked after connecting, logged), "
        "else CPU.",
    )
    resources_per_worker: dict[str, float] | None = Field(
        None,
        description='Ray resources per worker, e.g. {"CPU": 2}; null lets Ray default to 1 CPU. '
        "Torch threads per worker follow the CPU count.",
    )
    sync_batchnorm: bool = Field(
        False,
        description="Convert the stage's trainable BatchNorm layers to SyncBatchNorm, so batch statistics "
        "are computed over all workers' batches (GPU stages with more than one worker; an error on CPU).",
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="How the workers share the stage: `ddp` keeps a full copy of the trainable weights, "
        "gradients and optimizer state on every worker; `fsdp` shards them across the workers (PyTorch "
        "FSDP2 `fully_shard` on each trainable layer, the frozen upstream left whole on every worker), so "
        "a stage bigger than one worker's memory fits. Checkpoints and the artifact hold the full, "
        "unsharded state either way. With one worker `fsdp` runs unsharded, exactly as `ddp`. Not with "
        "`sync_batchnorm`, `solver.precision: fp16` or `loss.weighting: uncertainty`.",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="How Ray places the stage's workers (its placement group's strategy): `PACK` on as few "
        "nodes as possible, `SPREAD` over as many as possible (both best effort); `STRICT_PACK` all on "
        "one node, `STRICT_SPREAD` each on a different node (checked before the stage starts: an error "
        "when the cluster has too few nodes that fit).",
    )


def _on_off(value: Any) -> Any:
    """YAML 1.1 (PyYAML) reads bare ``on``/``off`` as true/false: take them as the words."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class FreezeConfig(_Strict):
    """How this stage sees its frozen upstream."""

    cache_features: Annotated[Literal["auto", "on", "off"], BeforeValidator(_on_off)] = Field(
        "auto",
        description="Compute the frozen upstream's outputs once (batched, in parallel over the stage's "
        "workers), keep them in the object store and as Parquet under `{storage_path}/{name}/cache/`, and "
        "train this stage (and every Tune trial of it) on them instead of re-running the upstream each "
        "step. Possible only when nothing upstream trains (no `trainable_layers`, not a joint stage) and "
        "the inputs are deterministic (no `train.augment`). `auto`: on when possible and the features fit "
        "in half the object store, otherwise off with the reason logged; `on`: the same, but an impossible "
        "cache is an error; `off`: never. Not part of the stage fingerprint (it changes how inputs are "
        "computed, not what is trained).",
    )


def _path_only(value: Any) -> Any:
    """``pretrained: /abs/w.safetensors`` is ``pretrained: {path: /abs/w.safetensors}``."""
    return {"path": value} if isinstance(value, str) else value


class PretrainedConfig(_Strict):
    """A state-dict file loaded into a stage's module, and how its keys map onto the module's."""

    path: str = Field(
        description="Absolute path of the state-dict file: `.safetensors`, or `.pt`/`.pth` loaded with "
        "`weights_only`. Its sha256 is part of the stage fingerprint, so changed bytes never reuse an "
        "old artifact."
    )
    prefix: str = Field(
        "",
        description="Keep only the file's keys that start with this prefix, and strip it (e.g. `features.` "
        "imports the `features.*` part of a whole network's state dict into this stage's module). Applied "
        "before `rename`.",
    )
    rename: dict[str, str] = Field(
        default_factory=dict,
        description="Key prefix -> replacement, applied after `prefix` (the longest matching prefix wins; "
        "e.g. `{backbone.: '', fc.: head.}`). Two file keys mapping to one module key is an error.",
    )
    strict: bool = Field(
        True,
        description="`true`: every module key must come from the file and every mapped file key must be "
        "a module key. `false` (as torch's `load_state_dict(strict=False)`): module keys the file lacks keep "
        "their fresh initialization and mapped file keys the module lacks are ignored, both listed in a "
        "warning; at least one key must match, and shapes must always agree.",
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
    pretrained: Annotated[PretrainedConfig | None, BeforeValidator(_path_only)] = Field(
        None,
        description="State dict loaded into this stage's module before training (or instead of it, with "
        "`train.epochs: 0`): a path, or `{path, prefix, rename, strict}`. Checked before Ray: keys and "
        "shapes against the module after the mapping, dtypes (floats of another precision are cast to "
        "the module's with a note; integer or bool where a float belongs is an error) and, for files up "
        "to 256 MiB at validate and always before a run starts, NaN/Inf (an error naming the key). Only "
        "the module: the stage's head and adapter start fresh. With `data.normalize`, give the "
        "statistics the weights were trained with.",
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
    freeze: FreezeConfig = Field(default_factory=FreezeConfig, description="Frozen-upstream handling (feature cache).")
    seed: int | None = Field(
        None,
        ge=0,
        le=2**32 - 1,
        description="This stage's own seed for its weight initialization and the random streams of its training "
        "(dropout, augmentation); null: derived from the pipeline `seed` and the stage's position. The batch "
        "order always follows the pipeline seed, so sweeping it (`space: {seed: {grid: [0, 1, 2]}}`, plain or "
        "batched) varies the initialization and dropout of one stage on the same batches.",
    )
    max_failures: int = Field(
        0,
        ge=-1,
        description="Worker-group restarts Ray Train may do for this stage after a worker crash (-1: "
        "unlimited); each restart resumes from the latest checkpoint with optimizer, schedule, scaler, "
        "RNG and step counters. An error a restart would repeat (a training health rule with policy "
        "`error`, such as a NaN loss, or frozen drift) ends the stage at once.",
    )
    memory_format: Literal["auto", "channels_last", "contiguous"] = Field(
        "auto",
        description="Memory format of a stage whose model has 2-D convolutions (parameters and input batches). "
        "`auto`: channels_last where benchmarks/bench_precision.py measured it faster for the device type, "
        "capability and resolved precision (the table in cascade_ray/solver/precision.py), else contiguous; "
        "stages without convolutions stay contiguous. Recorded in the stage record.",
    )
    compile: bool = Field(
        False,
        description="Wrap the stage's own module in torch.compile (in place, so weights and checkpoints keep "
        "their names). The compile time is reported in the stage record; where the backend is unavailable "
        "(e.g. no C++ compiler for inductor on CPU) the stage says so and trains eagerly.",
    )
    head: HeadConfig = Field(default_factory=HeadConfig, description="The stage's head.")
    loss: LossConfig = Field(default_factory=LossConfig, description="The stage's loss.")
    solver: SolverConfig = Field(default_factory=SolverConfig, description="The stage's optimizer.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The stage's schedule.")
    scaling: ScalingConfig = Field(default_factory=ScalingConfig, description="The stage's Ray Train scaling.")
    health: HealthConfig = Field(default_factory=HealthConfig, description="The stage's runtime health rules.")


class MlflowLoggerConfig(_Strict):
    """MLflow tracking: one parent run per pipeline run, a nested run per stage and per Tune trial."""

    tracking_uri: str = Field(
        min_length=1,
        description="The MLflow tracking server (`http://host:5000`, `https://...`), or a local database "
        "(`sqlite:////abs/path/mlflow.db`, one machine only: every worker writes to it). A server must answer "
        "before Ray starts: validate and every run probe it.",
    )
    experiment: str = Field(
        "cascade-ray", min_length=1, description="MLflow experiment the runs go to (created when missing)."
    )
    run_name: str | None = Field(None, min_length=1, description="Name of the parent run; null: the pipeline's `name`.")


class WandbLoggerConfig(_Strict):
    """Weights & Biases: one run per stage and per Tune trial, grouped by pipeline run."""

    project: str = Field(min_length=1, description="W&B project.")
    entity: str | None = Field(None, min_length=1, description="W&B entity (team or user); null: your default.")
    mode: Literal["online", "offline"] = Field(
        "online",
        description="`online` needs the W&B server (validate probes it); `offline` writes the runs under "
        "`{run}/wandb/` for `wandb sync` later.",
    )


class LoggersConfig(_Strict):
    """Live tracking: rank 0 of each stage logs its step and epoch metrics as they happen."""

    tensorboard: bool = Field(
        False,
        description="Rank 0 writes `{run}/tensorboard/<stage>/` while the stage trains (needs the "
        "`tensorboard` package). false: the driver writes the same event files once the run has "
        "finished, when tensorboard is installed.",
    )
    mlflow: MlflowLoggerConfig | None = Field(
        None, description="MLflow tracking (`pip install 'cascade-ray[mlflow]'`)."
    )
    wandb: WandbLoggerConfig | None = Field(None, description="W&B tracking (`pip install 'cascade-ray[wandb]'`).")

    @property
    def any(self) -> bool:
        """Whether a live logger is configured."""
        return self.tensorboard or self.mlflow is not None or self.wandb is not None


class PipelineConfig(_Strict):
    """A whole cascade: data, and the stages in the order they train."""

    name: str = Field(pattern=STAGE_NAME_PATTERN, description="Run name; artifacts go to storage_path/name.")
    seed: int = Field(
        0,
        ge=0,
        le=2**32 - 1,
        description="Seed for data splits, initialization and shuffling (scikit-learn's range: 0 to 2**32 - 1).",
    )
    deterministic: bool = Field(
        False,
        description="Deterministic kernels on every worker (torch.use_deterministic_algorithms, no cuDNN "
        "autotuning, CUBLAS_WORKSPACE_CONFIG set): a stage resumed after a crash then ends bit-identical to "
        "an uninterrupted one on GPUs too (CPU runs already are). Slower on GPU; an op with no "
        "deterministic implementation raises.",
    )
    storage_path: str = Field(
        "~/cascade-ray-runs",
        description="Where artifacts, Ray Train runs and summary.json go: a local path (made absolute when "
        "the driver starts; refused if relative inside a Ray job) or a pyarrow.fs URI (s3://bucket/prefix, "
        "gs://bucket/prefix, file:///abs/path). On a multi-machine cluster it must be storage every node "
        "reaches (a URI or a shared mount); a node-local path is an error there.",
    )
    data: DataConfig = Field(default_factory=DataConfig, description="The data section.")
    stages: list[StageConfig] = Field(min_length=1, description="Stages, in training order.")
    loggers: LoggersConfig = Field(
        default_factory=LoggersConfig, description="Live tracking: TensorBoard, MLflow, W&B."
    )
    trusted_modules: list[str] = Field(
        default_factory=list,
        description="Packages whose callables model.type / loss.type import paths (package.module:Callable) may "
        "name, besides cascade_ray's own: trusting mypkg allows mypkg.models:Net. Each is code cascade-ray will "
        "import and call, so list only packages you trust; the standard library is never allowed. "
        "`--trust MODULE` adds to it. See docs/security.md.",
    )

    def stage_index(self, name: str) -> int:
        """Index of the stage called `name` (KeyError when absent)."""
        for i, stage in enumerate(self.stages):
            if stage.name == name:
                return i
        raise KeyError(name)
