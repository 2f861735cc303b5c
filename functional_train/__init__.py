"""functional_train: pure, composable gradient transformations for PyTorch.

The same chain runs in one process on plain tensors and across tensor x data x pipeline x expert
parallel meshes on DTensors, with the same numbers. See the README.
"""

from . import checkpoint, schedules
from .accumulation import MultiStepsState, has_updated, multi_steps
from .autograd import differentiable, is_differentiable
from .averaging import EmaParamsState, averaged_params, ema_params
from .base import EmptyState, GradientTransformation, chain, identity, named_chain
from .came import ScaleByCameState, came, scale_by_came
from .clipping import ClipByGlobalNormState, clip, clip_by_global_norm, global_norm
from .combine import MaskedState, PartitionState, masked, partition
from .extend import ElementwiseState, elementwise
from .factored import (
    EmaState,
    ScaleByFactoredRmsState,
    adafactor,
    clip_by_block_rms,
    ema,
    relative_step_schedule,
    scale_by_factored_rms,
    scale_by_param_block_rms,
)
from .func import vmap
from .galore import GaLoreState, galore, galore_adamw, galore_param_labels
from .hyperparams import (
    InjectHyperparamsState,
    get_hyperparams,
    inject_hyperparams,
    set_hyperparams,
)
from .mesh import Mesh
from .muon import (
    MUON_EXCLUDE,
    MuonDimensionNumbers,
    ScaleByMuonState,
    muon,
    muon_param_labels,
    newton_schulz,
    scale_by_muon,
)
from .nonfinite import (
    ApplyIfFiniteState,
    DynamicLossScaleState,
    ZeroNansState,
    all_finite,
    apply_if_finite,
    dynamic_loss_scale,
    loss_scale,
    skip_large_updates,
    skip_not_finite,
    zero_nans,
)
from .optimizers import adam, adamw, lamb, sgd
from .precompile import PrecompiledStep, precompiled_step
from .privacy import DifferentiallyPrivateAggregateState, differentially_private_aggregate
from .quantization import (
    ScaleByAdam8bitState,
    create_dynamic_map,
    dequantize_blockwise,
    quantize_blockwise,
)
from .step import step
from .torch_optimizer import TorchOptimizer
from .transforms import (
    ScaleByAdamState,
    ScaleByAmsgradState,
    ScaleByScheduleState,
    TraceState,
    add_decayed_weights,
    decay_mask,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_trust_ratio,
    trace,
)
from .tree import tree_get
from .update import apply_updates
from .zero import ZeroRedundancyState, zero_redundancy

__version__ = "0.1.0"


def _register_safe_globals() -> None:
    """Let plain ``torch.load`` (``weights_only=True``, its default since torch 2.6) read the
    states ``torch.save`` wrote: every state type of the library is a NamedTuple of tensors,
    registered with ``torch.serialization.add_safe_globals`` at import."""
    import torch.serialization

    from .factored import StepSizeDecayState

    torch.serialization.add_safe_globals(
        [
            EmptyState,
            MultiStepsState,
            MaskedState,
            PartitionState,
            ScaleByCameState,
            ClipByGlobalNormState,
            EmaState,
            ScaleByFactoredRmsState,
            StepSizeDecayState,
            GaLoreState,
            ScaleByAdam8bitState,
            ScaleByAdamState,
            ScaleByAmsgradState,
            ScaleByScheduleState,
            TraceState,
            ZeroRedundancyState,
            ApplyIfFiniteState,
            DynamicLossScaleState,
            ZeroNansState,
            InjectHyperparamsState,
            EmaParamsState,
            ScaleByMuonState,
            ElementwiseState,
            DifferentiallyPrivateAggregateState,
        ]
    )


_register_safe_globals()

__all__ = [
    # base
    "differentiable",
    "is_differentiable",
    "vmap",
    "GradientTransformation",
    "EmptyState",
    "elementwise",
    "ElementwiseState",
    "identity",
    "chain",
    "named_chain",
    "apply_updates",
    "Mesh",
    "tree_get",
    "step",
    "precompiled_step",
    "PrecompiledStep",
    "partition",
    "PartitionState",
    "masked",
    "MaskedState",
    # clipping
    "clip",
    "clip_by_global_norm",
    "ClipByGlobalNormState",
    "global_norm",
    # accumulation
    "multi_steps",
    "MultiStepsState",
    "has_updated",
    # parameter averaging
    "ema_params",
    "EmaParamsState",
    "averaged_params",
    # torch.optim adapter
    "TorchOptimizer",
    # hyperparameters as state
    "inject_hyperparams",
    "InjectHyperparamsState",
    "set_hyperparams",
    "get_hyperparams",
    # non-finite gradients and loss scaling
    "apply_if_finite",
    "ApplyIfFiniteState",
    "zero_nans",
    "ZeroNansState",
    "all_finite",
    "dynamic_loss_scale",
    "DynamicLossScaleState",
    "loss_scale",
    "skip_not_finite",
    "skip_large_updates",
    # ZeRO
    "zero_redundancy",
    "differentially_private_aggregate",
    "DifferentiallyPrivateAggregateState",
    "ZeroRedundancyState",
    # transforms
    "scale",
    "scale_by_learning_rate",
    "ScaleByScheduleState",
    "add_decayed_weights",
    "decay_mask",
    "trace",
    "TraceState",
    "scale_by_adam",
    "ScaleByAdamState",
    "ScaleByAmsgradState",
    "scale_by_trust_ratio",
    # 8-bit block-wise states (bitsandbytes style)
    "ScaleByAdam8bitState",
    "create_dynamic_map",
    "quantize_blockwise",
    "dequantize_blockwise",
    # factored second moments (Adafactor)
    "scale_by_factored_rms",
    "ScaleByFactoredRmsState",
    "clip_by_block_rms",
    "scale_by_param_block_rms",
    "relative_step_schedule",
    "ema",
    "EmaState",
    # CAME
    "scale_by_came",
    "ScaleByCameState",
    # GaLore
    "galore",
    "GaLoreState",
    "galore_adamw",
    "galore_param_labels",
    "muon",
    "muon_param_labels",
    "MuonDimensionNumbers",
    "MUON_EXCLUDE",
    "newton_schulz",
    "scale_by_muon",
    "ScaleByMuonState",
    # optimizers
    "sgd",
    "adam",
    "adamw",
    "adafactor",
    "lamb",
    "came",
    # modules
    "schedules",
    "checkpoint",
]
