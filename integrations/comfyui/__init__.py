"""dattn's ComfyUI node pack: copy or link this folder into ComfyUI/custom_nodes/ (with dattn
installed into ComfyUI's Python environment: pip install dattn). README.md has the steps.

- The node **DattnAttention** (MODEL in, MODEL out): a clone of the model whose attention runs on
  dattn (``dattn.comfyui.patch_model``): the backend (FLASH, SAGE, VIDEO_SPARSE) and its
  options as ``key=value, ...`` (FLASH: ``isa``, ``compute_dtype``; SAGE: ``pv_dtype``,
  ``smooth_k``, ``balance_qk``, ``rotate``, ``isa``; VIDEO_SPARSE: ``sparsity``, ``topk``,
  ``tile``, ``dense_steps``, ``dense_layers``, ``refresh_steps``, ...). Two such nodes in a
  row: the later one's backend and options win.
- At load, the attention functions ``"dattn"`` and ``"dattn_sage"`` are registered with
  ComfyUI's ``register_attention_function``, for nodes that look attention up by name.
"""

import dattn.comfyui as _dattn_comfyui


class DattnAttention:
    """ComfyUI's attention on dattn (docs/comfyui.md in dattn's repository)."""

    CATEGORY = "advanced/attention"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    DESCRIPTION = ("Runs the model's attention on dattn's CPU kernels: FLASH (exact), SAGE "
                   "(8-bit), or VIDEO_SPARSE (block-sparse over Wan's video grid).")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL",),
                "backend": (["FLASH", "SAGE", "VIDEO_SPARSE"], {"default": "FLASH"}),
            },
            "optional": {
                "options": ("STRING", {"default": "", "multiline": False,
                                       "tooltip": "backend options: key=value, key=value"}),
            },
        }

    def patch(self, model, backend, options=""):
        return (_dattn_comfyui.patch_model(model, backend,
                                           **_dattn_comfyui.parse_options(options)),)


NODE_CLASS_MAPPINGS = {"DattnAttention": DattnAttention}
NODE_DISPLAY_NAME_MAPPINGS = {"DattnAttention": "Attention on dattn (CPU)"}

_dattn_comfyui.register()
