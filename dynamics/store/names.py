"""Every name a run file uses, defined once: the writers (recorder, probes) and the readers
(analysis, experiments, CLI) import these instead of repeating string literals.

A group is a set of series sharing one ``step`` index; each group's series names follow it.
A user's own probe may add groups of any other name.
"""

from urllib.parse import quote, unquote

# Root attributes.
ATTR_RUN_NAME = "run_name"
ATTR_CONFIG = "config"
ATTR_VERSIONS = "versions"
ATTR_LAYOUT = "layout"
ATTR_THETA0_SHA256 = "theta0_sha256"
ATTR_RUN_ID = "run_id"  # written when the file is created, kept by resumes: which run it is
ATTR_FROZEN_SHA256 = "frozen_sha256"  # of the frozen parameters at θ0 (absent: none)
ATTR_MODULE = "module"  # {"class_path", "init_args": {...}, "unrecorded_init_args": [...]}
ATTR_BUFFERS = "buffers"  # the persistent buffers' layout: names, shapes, dtypes, unstored
ATTR_PROBES = "probes"  # [{"class", "name", "every_n_steps", "settings"}, ...]
# What the fit was, recorded at its first batch so that runs of any project can be compared.
ATTR_SUBMODULES = "submodules"  # {module name: [class path, extra_repr()]}
ATTR_COMPILED = "compiled"  # names of the parts torch.compile compiled ("": the whole module)
ATTR_OPTIMIZERS = "optimizers"  # [{"class_path", "param_groups": [{hyperparameter: value}]}]
ATTR_SCHEDULERS = "schedulers"  # [{"class_path", "interval", "frequency", "state": {...}}]
ATTR_PRECISION = "precision"  # the loop's, e.g. "32-true", "bf16-mixed"
ATTR_LOOP = "loop"  # the training loop: "lightning", "huggingface", "accelerate", "plain"
ATTR_LOSS_RULE = "loss_rule"  # {"rule": "lightning" | "output" | "function", "function": path}
ATTR_DATA = "data"  # {"datamodule": {"class_path", "init_args"}, "train": [{"dataset", ...}]}
# What callbacks did to the module before θ0 was recorded, in the callbacks' order: one record
# per callback with a dynamics_edit() method, [{"class_path", "edit", "settings", "table"}].
ATTR_MODEL_EDITS = "model_edits"
EDIT_SHIFT = "shift_activations"  # table rows: module, activation, replaced, shift, c, note
EDIT_INIT_BIASES = "init_biases"  # table rows: module, parameter, value

# Per-dataset attributes.
ATTR_COLUMNS = "columns"  # names of a series' last axis
ATTR_VIEW = "view"  # how a series is drawn (schema.View as JSON)
ATTR_ENCODING = "encoding"  # how stored values decode, e.g. "bfloat16" kept as its uint16 bits
# A series' name as its probe declared it (any text, e.g. Lightning's "val_loss/dataloader_idx_0");
# its dataset is named series_name() of it. Files from before it was stored name series as is.
ATTR_NAME = "declared_name"

#: Characters a series keeps in its dataset's name besides ASCII letters and digits (and the
#: "~" quote always keeps); every other byte is escaped as %XX.
_SAFE = "_.-"
#: Dataset names that a plain escape would keep but that mean something else in a group: its
#: step index, HDF5's own "." and "..", and the empty name.
_RESERVED = {"step", ".", ".."}
_EMPTY = "%"  # no escaped name is a lone "%"


def series_name(name: str) -> str:
    """The dataset name of a series declared as ``name``: safe for HDF5 and any of its tools
    (no ``/``, no ``.`` alone, ASCII), one-to-one, and ``name`` itself for plain names.

    ASCII letters, digits and ``_.-~`` are kept; every other byte of the UTF-8 name is written
    ``%XX``; a name a group reserves (``step``, ``.``, ``..``) has its first character escaped.
    :func:`declared_name` inverts it.
    """
    if not name:
        return _EMPTY
    safe = quote(name, safe=_SAFE, encoding="utf-8", errors="surrogatepass")
    if safe in _RESERVED:
        safe = f"%{ord(safe[0]):02X}{safe[1:]}"
    return safe


def declared_name(dataset_name: str) -> str:
    """The series name :func:`series_name` turned into ``dataset_name``."""
    if dataset_name == _EMPTY:
        return ""
    return unquote(dataset_name, encoding="utf-8", errors="surrogatepass")


# Events: one row per thing a probe reported (disabled, failed, warned), its own step index.
EVENTS = "events"
EVENT_STEP = "step"
EVENT_PROBE = "probe"
EVENT_KIND = "kind"
EVENT_MESSAGE = "message"
EVENT_DISABLED = "disabled"  # the probe stepped aside (ProbeUnavailable)
EVENT_ERROR = "error"  # the probe raised; it is disabled for the rest of the run
EVENT_WARNING = "warning"  # a note; the probe goes on
EVENT_WRITER = "writer"  # the probe name of events the writer records about the file itself
EVENT_RECORDER = "recorder"  # the probe name of events about the fit (how it was resumed)

# Run status: fixed-size datasets updated in place (nothing can be created under SWMR).
STATUS = "status"
STATUS_STATE = "state"
STATUS_EXCEPTION = "exception"  # "Type: message" of the exception that ended a crashed run
STATUS_LAST_STEP = "last_step"  # the largest step of any row made durable (-1: none yet)
STATUS_WALL_TIME = "wall_time_s"  # seconds of writing, summed over resumed fits
STATUS_STARTED = "started_at"  # Unix time the file was created
STATUS_UPDATED = "updated_at"  # Unix time of the last flush
STATUS_PID = "pid"  # the writing process, so a reader can tell a live run from a killed one
STATUS_HOST = "host"
RUNNING = "running"
FINISHED = "finished"
CRASHED = "crashed"
KILLED = "killed"  # never stored: inferred by the reader for a run whose writer is gone
UNKNOWN = "unknown"  # files written before the status was recorded

# Vectors, written once.
THETA0 = "theta0"
THETA_FINAL = "theta_final"
G0 = "g0"
PLANE_U = "plane_u"
PLANE_V = "plane_v"
PROBE_BATCH_PREFIX = "probe_batch."  # probe_batch.<i>: the i-th tensor leaf of the batch
PROBE_BATCH_STRUCTURE = "probe_batch_structure"  # key of GradientPlane's settings: the batch's tree
THETA_FINAL_STEP = "theta_final_step"  # the optimizer steps taken when θT was stored
# Buffers stored with θ0 and θT: one flat vector per stored dtype, <prefix>.<dtype> (e.g.
# theta0_buffers.float32); snapshots hold them as the series buffers.<dtype>.
THETA0_BUFFERS = "theta0_buffers"
THETA_FINAL_BUFFERS = "theta_final_buffers"


def buffer_vector(prefix: str, dtype: str) -> str:
    """The vector (or snapshot series) holding the buffers stored as ``dtype`` under ``prefix``."""
    return f"{prefix}.{dtype}"


# Plane views evaluated in the training process at the end of fit (GradientPlane(at_end=True)):
# plane_end.steps (checkpoint steps, NaN-padded), and per view (PLANE_END_VIEWS) its grid axes,
# heatmap and trajectory (one row per checkpoint, columns PLANE_END_TRAJECTORY_COLUMNS); the
# out-of-plane view also stores its basis. The first view's plane is plane_u/plane_v.
PLANE_END_STEPS = "plane_end.steps"
PLANE_END_VIEWS = ("plane", "out_of_plane")
PLANE_END_TRAJECTORY_COLUMNS = ("a", "b", "r", "loss", "plane_loss")


def plane_end(view: str, field: str) -> str:
    """The vector of ``field`` (alphas, betas, losses, trajectory, u, v) of an at-end view."""
    return f"plane_end.{view}.{field}"


def float_bits(probe: str) -> str:
    """The vector holding the float width (32/64) a probe's extra passes computed in."""
    return f"{probe}_float_bits"


# Series groups and their series.
LOSS = "loss"
LOSS_TRAIN = "train"

VALIDATION = "validation"  # one series per logged key
VAL_LOSS = "val_loss"  # the held-out loss, when the module logs it under this name

HIDDEN_NORMS = "hidden_norms"
HIDDEN_NORM = "norm"

ACTIVATION_BIAS = "activation_bias"
ACTIVATION_MEAN = "mean"

# HiddenStateNorms(unit_health=True): fractions per activation module / recorded output.
UNIT_HEALTH = "unit_health"
UNIT_DEAD = "dead"  # units at the ReLU family's flat value for every sample
UNIT_SATURATED = "saturated"  # units within 1e-3 of a sigmoid/tanh bound for every sample
UNIT_NONFINITE = "nonfinite"  # NaN and ±inf entries

DISPLACEMENT = "displacement"
DISPLACEMENT_TOTAL = "total"
DISPLACEMENT_PER_TENSOR = "per_tensor"
DISPLACEMENT_UPDATE = "update"

SNAPSHOTS = "snapshots"
SNAPSHOT_THETA = "theta"
SNAPSHOT_BUFFERS = "buffers"  # series buffers.<dtype>: the buffers stored with each snapshot

HESSIAN = "hessian"
HESSIAN_EIGENVALUES = "eigenvalues"
HESSIAN_RESIDUALS = "residuals"
HESSIAN_ERROR_BOUNDS = "error_bounds"  # ‖r‖²/gap per eigenvalue; NaN where no gap is known
HESSIAN_CONVERGED = "converged"
HESSIAN_N_HVP = "n_hvp"
HESSIAN_LOSS = "loss"
HESSIAN_TRACE = "trace"
HESSIAN_TRACE_STDERR = "trace_stderr"
HESSIAN_GRADIENT_SHARE = "gradient_share"
HESSIAN_DENSITY_NODES = "density_nodes"
HESSIAN_DENSITY_WEIGHTS = "density_weights"
HESSIAN_OVERLAP = "overlap_previous"  # top-k eigenspace overlap with the previous record
HESSIAN_UPDATE_SHARE = "update_share"  # share of θt − θs in the top-k eigenspace at s
HESSIAN_BATCH_RAYLEIGH = "batch_rayleigh"  # v1ᵀ H_i v1 on each batch of a probe set, (N)
HESSIAN_BATCH_RAYLEIGH_STD = "batch_rayleigh_std"  # their sample standard deviation
HESSIAN_VECTORS = "hessian_vectors"  # top-k Ritz vectors at thinned records, within a budget
HESSIAN_VECTORS_RITZ = "vectors"  # (k, n) float32
# BlockHessian: the diagonal blocks H_bb of the Hessian (per layer, parameter group or pattern).
HESSIAN_BLOCKS = "hessian_blocks"
HESSIAN_BLOCKS_LAMBDA_MAX = "lambda_max"  # λ1(H_bb), one column per block
HESSIAN_BLOCKS_EIGENVALUES = "eigenvalues"  # (blocks, k); NaN past a block's size
HESSIAN_BLOCKS_RESIDUALS = "residuals"  # (blocks, k) ‖H_bb v − λ v‖; NaN past a block's size
HESSIAN_BLOCKS_CONVERGED = "converged"  # 1 per block whose Lanczos met the tolerance
HESSIAN_BLOCKS_N_HVP = "n_hvp"  # products of H each block used (eigenvalues and trace)
HESSIAN_BLOCKS_TRACE = "trace"  # tr H_bb: Hutchinson on shared probes, or exact
HESSIAN_BLOCKS_TRACE_STDERR = "trace_stderr"  # its standard error (0 when exact)

# BiasComponent: decodes of the activation-bias component and the remainder of chosen layers.
BIAS_COMPONENT = "bias_component"
BIAS_COMPONENT_IMAGES = "bias_component_images"  # decoded examples at thinned steps
BIAS_COMPONENT_DECODES = "decodes"  # (layers, full/bias/remainder, examples, C, H, W)
BIAS_COMPONENT_TARGET = "bias_component_target"  # the examples' target images, (examples, C, H, W)

PLANE = "plane"
PLANE_A = "a"
PLANE_B = "b"
PLANE_R = "r"

# LossChangeSplit: one step's loss change on the probe batch, one term per parameter group.
LOSS_CHANGE = "loss_change"
LOSS_CHANGE_TERMS = "terms"  # one column per group
LOSS_CHANGE_SHARE = "cumulative_share"  # Σ_t term / Σ_t ΔL over the recorded steps, per group
LOSS_CHANGE_DELTA = "delta"  # the measured ΔL
LOSS_CHANGE_LOSS = "loss"  # L(θ) before the step
LOSS_CHANGE_RESIDUAL = "residual"  # Σ terms − ΔL
LOSS_CHANGE_RELATIVE_RESIDUAL = "relative_residual"  # |Σ terms − ΔL| / |ΔL|
LOSS_CHANGE_CONVERGED = "converged"  # 1 when the residual met the tolerance
LOSS_CHANGE_EVALUATIONS = "gradient_evaluations"
LOSS_CHANGE_OPTIMIZER_STEPS = "optimizer_steps"  # optimizer steps the row's Δθ spans

# TrajectoryGeometry: the geometry of the path θ0 → θ1 → ..., one row per recorded step t,
# describing step t's update Δt = θt+1 − θt.
TRAJECTORY = "trajectory"
TRAJECTORY_PATH_LENGTH = "path_length"  # Σ_{s ≤ t} ‖Δs‖
TRAJECTORY_TORTUOSITY = "tortuosity"  # path length / ‖θt+1 − θ0‖
TRAJECTORY_UPDATE_COSINE = "update_cosine"  # cos(Δt−1, Δt)
TRAJECTORY_GRADIENT_COSINE = "gradient_cosine"  # cos(Δt, −gt)
# With per_tensor=True, the same per parameter tensor i (one column each).
TRAJECTORY_PATH_LENGTH_PER_TENSOR = "path_length_per_tensor"  # Σ_{s ≤ t} ‖Δs,i‖
TRAJECTORY_UPDATE_COSINE_PER_TENSOR = "update_cosine_per_tensor"  # cos(Δt−1,i, Δt,i)
TRAJECTORY_GRADIENT_COSINE_PER_TENSOR = "gradient_cosine_per_tensor"  # cos(Δt,i, −gt,i)

# GradientStats: the gradient the optimizer is handed, one row per recorded step.
GRADIENT_STATS = "gradient_stats"
GRADIENT_NORM = "norm"  # ‖g‖ after clipping (what the optimizer steps with)
GRADIENT_NORM_BEFORE_CLIP = "norm_before_clip"  # ‖g‖ after AMP unscaling, before clipping
GRADIENT_NORM_PER_TENSOR = "norm_per_tensor"  # ‖g_i‖ after clipping, one column per tensor
GRADIENT_NOISE_SCALE = "noise_scale"  # B_simple = tr Σ / ‖G‖² (McCandlish et al. 2018)
GRADIENT_SQUARED_NORM = "squared_norm"  # the unbiased estimate of ‖G‖²
GRADIENT_TRACE_COVARIANCE = "trace_covariance"  # the unbiased estimate of tr Σ
GRADIENT_BATCH_SMALL = "batch_small"  # B_small: the micro-batches' harmonic mean size
GRADIENT_BATCH_BIG = "batch_big"  # B_big = accumulate_grad_batches · B_small
