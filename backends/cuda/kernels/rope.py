"""Rotary position embedding (``cuda/rope.cu``), NORMAL and NEOX, optionally Q and K in one launch.
"""

from __future__ import annotations

from metatp.backends.cuda.launch import BLOCK_1D, check_f32, check_i32, f32, grid1d, head_strides, i32, launch

__all__ = ['ENTRY_POINTS', 'rope']

ENTRY_POINTS = ["rope_norm_f32", "rope_neox_f32"]



def rope(x, y, pos, *, head_dim: int, n_head: int, n_tokens: int, n_dims: int,
         freq_base: float, freq_scale: float = 1.0, neox: bool = False, freq_factors=None,
         attn_factor: float = 1.0, x_strides=None, y_strides=None, second=None) -> None:
    """RoPE on f32 ``x`` [n_tokens, n_head, head_dim] (numpy order) into ``y`` (may be x).

    ``pos``: int32 [n_tokens] in device memory (read by the kernel: a captured graph
    replays with new positions). ``x_strides``/``y_strides``: (head stride, token stride)
    in elements; default from 3-D arrays, else contiguous. ``neox``: rotate halves.
    ``second``: optional (x2, y2, n_head2, x2_strides, y2_strides), rotated in the same
    launch with the same positions (Q and K of a layer).
    """
    check_f32(x, y, freq_factors)
    check_i32(pos)
    if head_dim % 2 or n_dims % 2 or n_dims > head_dim:
        raise ValueError("head_dim and n_dims must be even and n_dims <= head_dim")
    xs1, xs2 = head_strides(x, head_dim, n_head, x_strides)
    ys1, ys2 = head_strides(y, head_dim, n_head, y_strides)
    x2 = y2 = None
    n_head2, x2s, y2s = 0, (0, 0), (0, 0)
    if second is not None:
        x2, y2, n_head2, x2_strides, y2_strides = second
        check_f32(x2, y2)
        x2s = head_strides(x2, head_dim, n_head2, x2_strides)
        y2s = head_strides(y2, head_dim, n_head2, y2_strides)
    total = head_dim // 2 * (n_head + n_head2) * n_tokens
    if total == 0:
        return
    launch("rope", "rope_neox_f32" if neox else "rope_norm_f32", grid1d(total), (BLOCK_1D,),
           (x, y, x2, y2, pos, freq_factors, i32(head_dim), i32(n_head), i32(n_head2),
            i32(n_tokens), i32(n_dims), i32(xs1), i32(xs2), i32(ys1), i32(ys2),
            i32(x2s[0]), i32(x2s[1]), i32(y2s[0]), i32(y2s[1]), f32(freq_base),
            f32(freq_scale), f32(attn_factor)))
