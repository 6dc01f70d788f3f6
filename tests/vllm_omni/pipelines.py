"""Random-weight diffusers pipeline folders for vllm-omni's real engine, built offline (no hub):
Flux (FluxPipeline), Wan 2.1 text-to-video (WanPipeline) and Qwen-Image (QwenImagePipeline),
saved with ``save_pretrained`` as the engine loads a model folder.

    python pipelines.py OUT [flux] [wan] [qwen] [--widths tiny|real] [--dtype bfloat16|float32]

``tiny`` (the tests): 1 block of 2 heads x 16 channels, text encoders of width 32, VAEs of 8-16
channels with the real models' scale factors (8 in space; Wan 4 in time), so that the engine's
compulsory warm-up (512 x 512, 2 steps) costs little. ``real`` (bench/vllm_omni.py): the
transformer at Flux-dev's widths (1 double + 1 single block, 24 heads x 128) or Wan 2.1 1.3B's
(1 block, 12 heads x 128), with text encoders of the real output widths (T5 / UMT5: 4096, CLIP:
768) but one narrow layer, and the small VAEs with the real latent channels (16).

Tokenizers are made in memory (transformers' tokenizers-backed classes over tiny vocabularies:
CLIP's byte alphabet without merges, a Unigram T5 vocabulary, Qwen2's byte alphabet with its
chat tokens). The stored dtype is the engine's dtype (its text encoders load at the stored
dtype, its DiT at the engine's: they must agree).
"""

import argparse
import os
import string

import torch

SEED = 0


def _bytes_to_unicode():
    """The byte-level alphabet of GPT-2 / CLIP (tokenizers' ByteLevel pre-tokenizer)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
    bs += list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def clip_tokenizer(max_len=77):
    from transformers import CLIPTokenizer

    vocab = {t: i for i, t in enumerate(["<|startoftext|>", "<|endoftext|>"])}
    for ch in _bytes_to_unicode().values():
        for tok in (ch, ch + "</w>"):
            vocab.setdefault(tok, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_len)


def t5_tokenizer(max_len=512):
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    for i, ch in enumerate(string.ascii_letters + string.digits + string.punctuation):
        pieces.append((ch, -2.0 - i * 0.01))
        pieces.append(("\u2581" + ch, -1.5 - i * 0.01))
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_len)


def qwen2_tokenizer():
    from transformers import Qwen2Tokenizer

    vocab = {}
    for ch in _bytes_to_unicode().values():
        vocab.setdefault(ch, len(vocab))
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[t] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, bos_token=None,
                         eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         model_max_length=4096)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


def _t5_config(cls, vocab, width):
    return cls(vocab_size=vocab, d_model=width, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
               relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
               is_encoder_decoder=False, decoder_start_token_id=0, pad_token_id=0,
               eos_token_id=1)


def build_flux(out, widths="tiny"):
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline,
                           FluxTransformer2DModel)
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    real = widths == "real"
    torch.manual_seed(SEED)
    clip_tok, t5_tok = clip_tokenizer(), t5_tokenizer()
    pooled, joint = (768, 4096) if real else (32, 32)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(clip_tok), hidden_size=pooled, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=77, projection_dim=pooled,
        bos_token_id=0, eos_token_id=1, pad_token_id=1))
    text_encoder_2 = T5EncoderModel(_t5_config(T5Config, len(t5_tok), joint))
    latent = 16 if real else 4
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 16, 16),
        layers_per_block=1, latent_channels=latent, norm_num_groups=4, sample_size=64,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
        use_post_quant_conv=False)
    if real:  # Flux-dev's widths, 1 double + 1 single block
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
            attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
            pooled_projection_dim=768, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
    else:
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
            pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6))
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
        max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                        tokenizer=clip_tok, text_encoder_2=text_encoder_2, tokenizer_2=t5_tok,
                        transformer=transformer)


def build_wan(out, widths="tiny"):
    from diffusers import (AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline,
                           WanTransformer3DModel)
    from transformers import UMT5Config, UMT5EncoderModel

    real = widths == "real"
    torch.manual_seed(SEED)
    tok = t5_tokenizer()
    text = 4096 if real else 32
    text_encoder = UMT5EncoderModel(_t5_config(UMT5Config, len(tok), text))
    z = 16 if real else 4
    # x8 in space (3 downsamples), x4 in time.
    vae = AutoencoderKLWan(base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.0] * z,
                           latents_std=[1.0] * z)
    if real:  # Wan 2.1 1.3B's widths, 1 block
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
            in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960,
            num_layers=1, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
            rope_max_seq_len=1024)
    else:
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
            out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
            rope_max_seq_len=32)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=3.0)
    return WanPipeline(tokenizer=tok, text_encoder=text_encoder, vae=vae,
                       transformer=transformer, scheduler=scheduler)


def build_qwen(out, widths="tiny"):
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler,
                           QwenImagePipeline, QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    if widths != "tiny":
        raise ValueError("Qwen-Image is built tiny only")
    torch.manual_seed(SEED)
    tok = qwen2_tokenizer()
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 3, 3]},
            bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>")),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                           out_hidden_size=32, fullatt_block_indexes=[0]))
    text_encoder = Qwen2_5_VLForConditionalGeneration(cfg)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True],
                                 latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
        max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
        time_shift_type="exponential")
    return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                             tokenizer=tok, transformer=transformer)


BUILDERS = {"flux": build_flux, "wan": build_wan, "qwen": build_qwen}


def build(name: str, out: str, widths: str = "tiny", dtype: str = "bfloat16") -> str:
    """Builds pipeline ``name`` into folder ``out`` (kept if it holds one already)."""
    if os.path.exists(os.path.join(out, "model_index.json")):
        return out
    pipe = BUILDERS[name](out, widths)
    pipe.to(getattr(torch, dtype))
    pipe.save_pretrained(out)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("models", nargs="*", default=["flux", "wan", "qwen"])
    ap.add_argument("--widths", choices=("tiny", "real"), default="tiny")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    a = ap.parse_args()
    for name in a.models:
        path = build(name, os.path.join(a.out, f"{name}-{a.widths}-{a.dtype}"), a.widths, a.dtype)
        print("built", path)


if __name__ == "__main__":
    main()
