"""Engine build parameters: one frozen dataclass shared by compile, guard, loader and server, and by
the host: the contract between them. The host's render fills it from the recipe and writes it into the
compile step's inputs as params.json (PARAMS_FILE); the compile step reads that file, records the
same fields in engine.json, and the guard, loader and server read them back from there.
tests/unit/test_contract.py checks that image.schema.json's engine section agrees with it.

Torch-free on purpose: the host imports this module (and the registry and errors it needs) only."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from .backends.registry import BACKENDS, backend_info
from .errors import UsageError

POOLINGS = ("mean", "last", "cls")
PRECISIONS = ("fp32", "bf16", "fp16", "int8", "fp8")
# The oldest GPU arch that computes in a precision (fp8: its tensor cores; _scaled_mm refuses older ones),
# for the runtime's guard. The sourced fact is the knowledge base's (builder/data/compat.yaml, precisions),
# which the plan reads and the runtime cannot; tests/unit/test_guard.py holds the two equal.
PRECISION_MIN_SM = {"fp8": 89}
HARDWARE_COMPATIBILITY = ("none", "ampere_plus", "same_compute_capability")
DEVICES = ("cpu", "cuda")
# Inductor modes for the torch-aot and torch-inductor backends (autotuning happens once, at image build).
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
# mask: the model's own attention mask (any model; last-token pooling pads on the left).
# causal: causal decoders only; pad on the right and let SDPA apply causality with no mask tensor
# (its flash kernel; see causal_attention.py). Exact for the real tokens either way.
ATTENTIONS = ("mask", "causal")
# padded: [batch, length] tensors and a mask. packed: every sequence of a call in one token stream,
# attention kept per sequence (packed.py); calls are cut by a token budget (max_batch_tokens).
INPUT_FORMS = ("padded", "packed")
# The loader pads sequences up to a multiple of this, so few distinct shapes reach the kernels.
SEQ_BUCKET = 8
MAX_BATCH = 4096
MAX_SEQ_LEN = 32768
PARAMS_FILE = "params.json"  # in the compile step's inputs
PADDED_SHAPE_POLICY = f"dynamic batch 1..max_batch, seq 2..max_seq_len, padded to multiple of {SEQ_BUCKET}"
PACKED_SHAPE_POLICY = "packed: up to max_batch sequences and max_batch_tokens tokens a call, no padding"


def backend_precisions(backend: str, device: str) -> tuple[str, ...]:
    """The precisions BACKEND compiles engines in on DEVICE (its description's precisions): what the plan
    checks a variant's precision against, and what EngineParams accepts."""
    return backend_info(backend).precisions(device)


@dataclass(frozen=True)
class EngineParams:
    backend: str = "torch-aot"
    device: str = "cpu"
    precision: str = "fp32"
    max_batch: int = 32
    max_seq_len: int = 512
    pooling: str = "mean"
    normalize: bool = True
    instruction: str | None = None
    # Where the weights live, so an opted-in host can recompile (images keep /opt/mopt/model).
    model_dir: str | None = None
    model_name: str | None = None
    compile_mode: str = "default"
    attention: str = "mask"
    input_form: str = "padded"
    # packed: the most tokens one engine call takes (0: max_batch * max_seq_len). Absent from older
    # engine.json files, which load as padded engines.
    max_batch_tokens: int = 0
    # Matryoshka: the smallest leading slice of the embedding the model was trained to serve
    # (Qwen3-Embedding: 32); requests may ask for any dimension from it to the full one.
    # None: the model declares no Matryoshka support (only the full dimension is served).
    # Absent from older engine.json files, which load with None.
    matryoshka_min_dim: int | None = None
    shape_policy: str = PADDED_SHAPE_POLICY
    # TensorRT optimisation profile and builder options (recipe engine.tensorrt; ignored elsewhere).
    # opt values of 0 mean "max_batch" / "max_seq_len".
    trt_min_batch: int = 1
    trt_opt_batch: int = 0
    trt_min_seq_len: int = 2
    trt_opt_seq_len: int = 0
    trt_opset: int = 17
    trt_hardware_compatibility: str = "none"
    trt_version_compatible: bool = False
    trt_timing_cache: bool = True
    trt_workspace_mib: int = 4096

    def __post_init__(self) -> None:
        if self.input_form == "packed" and self.shape_policy == PADDED_SHAPE_POLICY:
            object.__setattr__(self, "shape_policy", PACKED_SHAPE_POLICY)
        if self.device not in DEVICES:
            raise UsageError(f"--device must be one of {DEVICES}, got {self.device!r}")
        if self.precision not in PRECISIONS:
            raise UsageError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.pooling not in POOLINGS:
            raise UsageError(f"--pooling must be one of {POOLINGS}, got {self.pooling!r}")
        backend = backend_info(self.backend)
        takes = backend_precisions(self.backend, self.device)
        if self.precision not in takes:
            raise UsageError(f"--precision {self.precision} is not one {self.backend} takes on {self.device} "
                             f"({', '.join(takes)})")
        if self.compile_mode not in COMPILE_MODES:
            raise UsageError(f"--compile-mode must be one of {COMPILE_MODES}, got {self.compile_mode!r}")
        self._check_graph_form(backend)
        if self.trt_hardware_compatibility not in HARDWARE_COMPATIBILITY:
            raise UsageError(f"--trt-hardware-compatibility must be one of {HARDWARE_COMPATIBILITY}, "
                             f"got {self.trt_hardware_compatibility!r}")
        if self.trt_opset < 17:
            raise UsageError(f"--trt-opset must be >= 17, got {self.trt_opset}")
        if not 1 <= self.max_batch <= MAX_BATCH:
            raise UsageError(f"--max-batch must be in 1..{MAX_BATCH}, got {self.max_batch}")
        if self.matryoshka_min_dim is not None and (type(self.matryoshka_min_dim) is not int
                                                    or self.matryoshka_min_dim < 1):
            raise UsageError(f"--matryoshka-min-dim must be an integer >= 1, got {self.matryoshka_min_dim!r}")
        if not SEQ_BUCKET <= self.max_seq_len <= MAX_SEQ_LEN:
            raise UsageError(f"--max-seq-len must be in {SEQ_BUCKET}..{MAX_SEQ_LEN}, got {self.max_seq_len}")


    def _check_graph_form(self, backend) -> None:
        """attention and input form: which graph the torch backends export."""
        if self.attention not in ATTENTIONS:
            raise UsageError(f"--attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.attention == "causal" and not backend.causal_attention:
            causal = sorted(name for name, info in BACKENDS.items() if info.causal_attention)
            raise UsageError(f"--attention causal is implemented for {', '.join(causal)}, not {self.backend}")
        if self.input_form not in INPUT_FORMS:
            raise UsageError(f"--input must be one of {INPUT_FORMS}, got {self.input_form!r}")
        if self.input_form == "packed" and not backend.packed_input:
            packed = sorted(name for name, info in BACKENDS.items() if info.packed_input)
            raise UsageError(f"--input packed is implemented for {', '.join(packed)}, not {self.backend}")
        most = self.max_batch * self.max_seq_len
        if self.max_batch_tokens and not self.max_seq_len <= self.max_batch_tokens <= most:
            raise UsageError(f"--max-batch-tokens must be in max_seq_len..max_batch * max_seq_len "
                             f"({self.max_seq_len}..{most}), got {self.max_batch_tokens}")

    @property
    def pad_left(self) -> bool:
        """Last-token pooling pads on the left unless causal attention makes right padding exact (or
        nothing is padded)."""
        return self.pooling == "last" and self.attention == "mask" and self.input_form == "padded"

    @property
    def packed(self) -> bool:
        return self.input_form == "packed"

    @property
    def batch_tokens(self) -> int:
        """The most tokens one engine call takes."""
        return self.max_batch_tokens or self.max_batch * self.max_seq_len

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EngineParams:
        """From an engine.json's params: fields a newer mopt added are dropped (older engines load)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def parse(cls, data: object, source: str = PARAMS_FILE) -> EngineParams:
        """Strictly, from params.json: every key known, every value of its field's type, then validated."""
        if not isinstance(data, dict):
            raise UsageError(f"{source}: expected a JSON object of engine parameters")
        types = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(data) - set(types))
        if unknown:
            raise UsageError(f"{source}: unknown engine parameters {unknown} (known: {', '.join(types)})")
        for key, value in data.items():
            if not _of_type(value, types[key]):
                raise UsageError(f"{source}: {key} must be {types[key]}, got {value!r}")
        return cls(**data)

    @classmethod
    def read(cls, path) -> EngineParams:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise UsageError(f"{path}: cannot read engine parameters: {exc}") from None
        return cls.parse(data, str(path))


def _of_type(value: object, annotation: str) -> bool:
    """value against a field's annotation (a string under `from __future__ import annotations`)."""
    for name in (part.strip() for part in annotation.split("|")):
        if name == "None" and value is None:
            return True
        if name == "bool" and type(value) is bool:
            return True
        if name == "int" and type(value) is int:
            return True
        if name == "str" and type(value) is str:
            return True
    return False
