"""Attention kernels and the visibility description they share."""
from trm_jax.kernels.attention import attention
from trm_jax.kernels.attention_ref import attention_reference
from trm_jax.kernels.flash_attention import BlockSizes, flash_attention
from trm_jax.kernels.flash_attention_tpu import TPUBlockSizes, flash_attention_tpu
from trm_jax.kernels.visibility import (NEVER_EVICTED, LayerVisibility, Visibility,
                                        visible_mask)

__all__ = ["attention", "attention_reference", "BlockSizes", "flash_attention",
           "TPUBlockSizes", "flash_attention_tpu", "NEVER_EVICTED", "LayerVisibility",
           "Visibility", "visible_mask"]
