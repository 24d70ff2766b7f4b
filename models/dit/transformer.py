"""h3gen's MiniMax-H3 DiT: the diffusers checkpoint and forward contract, with fused weights and fast kernels.

Switches, each measurable on its own: `use_triton` (fused norm/modulate, QK-norm+RoPE, SwiGLU, gated residual),
`adaln_table` (modulation rows read from tables built by `precompute_adaln`), `compile_blocks` (regional
torch.compile of each block), `attention_backend` ("auto" or a name from `h3gen.kernels.attention_names.BACKENDS`),
`ffn_chunk_rows` (the feed-forward over row chunks, for memory), `exact_norms` (with `use_triton`: each norm's
statistic computed by torch, so the forward rounds as diffusers' does). With fa3-fp8 attention the QK-norm kernel
writes q, k and v in e4m3.
"""
import torch
import torch.nn as nn

from h3gen.kernels.attention import backend_name, choose_backend
from h3gen.models.dit.tags import MODALITIES
from h3gen.models.dit.blocks import (EXACT_NORM_OPS, REFERENCE_OPS, TRITON_OPS, H3Block, OutputNorm,
                                          RefinerBlock, TimeEmbedding, rotary_angles, rotary_inv_freq)
from h3gen.models.dit.checkpoint import H3DiTConfig, SafetensorsCheckpoint, fuse, is_fp32_key, read_config

# Timesteps are unscaled in [0, 1] and the highest sinusoid frequency is 1, so a 1e-6 mismatch moves the embedding
# by at most 1e-6: far below bf16 resolution. Anything further apart is a different noise level.
ADALN_TIMESTEP_TOLERANCE = 1e-6


def adaln_value_groups(timesteps):
    """AdaLN table values as groups: a tuple of sequences is several groups, anything else one group."""
    if isinstance(timesteps, tuple) and timesteps and all(
            isinstance(group, (list, tuple, torch.Tensor)) for group in timesteps):
        return list(timesteps)
    return [timesteps]


class FastH3Transformer(nn.Module):
    # Loads a diffusers `transformer/` folder itself (safetensors only); weight sources call `from_pretrained`
    # with h3gen's own arguments, or `from_reference` to take over a diffusers module.
    h3gen_loader = True

    def __init__(self, config: H3DiTConfig, use_triton=True, adaln_table=True, compile_blocks=False,
                 attention_backend="auto", ffn_chunk_rows=0, exact_norms=False):
        super().__init__()
        self.config = cfg = config
        self.proj_in = nn.Linear(cfg.video_patch_dim, cfg.hidden_size)
        self.audio_proj_in = nn.Linear(cfg.audio_in_channels, cfg.hidden_size)
        self.context_embedder = nn.Linear(cfg.text_dim, cfg.hidden_size)
        self.time_embedder = TimeEmbedding(cfg.freq_dim, cfg.time_embed_hidden_dim, cfg.time_embed_dim)
        self.token_refiner = nn.Module()
        self.token_refiner.refiner_blocks = nn.ModuleList(RefinerBlock(cfg) for _ in range(cfg.num_refiner_layers))
        self.token_refiner.final_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.final_norm_eps)
        self.transformer_blocks = nn.ModuleList(H3Block(cfg) for _ in range(cfg.num_layers))
        self.norm_out = OutputNorm(cfg)
        self.proj_out = nn.Linear(cfg.hidden_size, cfg.video_patch_dim)
        self.audio_proj_out = nn.Linear(cfg.hidden_size, cfg.audio_in_channels)
        self.register_buffer("adaln_timesteps", None, persistent=False)
        self.adaln_groups = {}  # a group's values (one forward's `timestep`) -> its first row in the tables
        self.streamer = None  # blocks whose weights stream from host memory (`stream_blocks`)
        self.compile_blocks = False
        self.configure(use_triton, adaln_table, compile_blocks, attention_backend, ffn_chunk_rows, exact_norms)

    def configure(self, use_triton=None, adaln_table=None, compile_blocks=None, attention_backend=None,
                  ffn_chunk_rows=None, exact_norms=None):
        """Flip switches on a built model (None keeps a switch as it is); regional compilation cannot be undone."""
        if use_triton is not None:
            self.use_triton = use_triton
        if exact_norms is not None:
            self.exact_norms = exact_norms
        self.ops = (EXACT_NORM_OPS if self.exact_norms else TRITON_OPS) if self.use_triton else REFERENCE_OPS
        if adaln_table is not None:
            self.adaln_table = adaln_table
        if ffn_chunk_rows is not None and ffn_chunk_rows < 0:
            raise ValueError(f"ffn_chunk_rows must be 0 (all rows at once) or more, got {ffn_chunk_rows}")
        if attention_backend is not None:
            backend_name("cpu", attention_backend)  # rejects unknown names early
            self.attention_backend = attention_backend
        for block in (*self.token_refiner.refiner_blocks, *self.transformer_blocks):
            block.ops, block.attention_backend = self.ops, self.attention_backend
            if ffn_chunk_rows is not None:
                block.ff.chunk_rows = ffn_chunk_rows
        if compile_blocks is not None and compile_blocks != self.compile_blocks:
            if not compile_blocks:
                raise ValueError("compiled blocks cannot be uncompiled; build a new model with compile_blocks=False")
            for block in self.transformer_blocks:
                # Inductor otherwise fuses the reference ops in fp32 and skips their bf16 roundings, drifting
                # further from diffusers' numerics.
                block.compile(options={"emulate_precision_casts": True})
            self.compile_blocks = True
        return self

    @classmethod
    def from_pretrained(cls, transformer_dir, dtype=torch.bfloat16, device="cpu", adaln_timesteps=None,
                        checkpoint_tensor=None, place_block=None, stream_blocks=0, **switches):
        """Load a diffusers `transformer/` folder. With `adaln_timesteps`, the AdaLN tables are built block by block
        while loading and the `adaln_proj` weights never become resident. `checkpoint_tensor(key, tensor)` sees each
        checkpoint tensor, under its diffusers key, before it is fused or used: adapters are added there;
        `place_block(index, block)` each block once it holds its weights (`_load`); the last `stream_blocks` blocks
        then go to host memory one by one (`stream_blocks`), so a DiT larger than the device can load."""
        with SafetensorsCheckpoint(transformer_dir, device) as checkpoint:
            def read(key):
                tensor = checkpoint.read(key).to(torch.float32 if is_fp32_key(key) else dtype)
                return checkpoint_tensor(key, tensor) if checkpoint_tensor is not None else tensor
            model = cls._assemble(read_config(transformer_dir), switches, device, read, adaln_timesteps, place_block,
                                  stream_blocks)
            if checkpoint.unread:
                raise ValueError(f"{transformer_dir} holds tensors this model does not use: {sorted(checkpoint.unread)}")
        return model

    @classmethod
    def from_reference(cls, reference, adaln_timesteps=None, checkpoint_tensor=None, device=None, place_block=None,
                       stream_blocks=0, **switches):
        """Take over an already-loaded diffusers `MiniMaxH3Transformer3DModel`. Its parameters are emptied as they are
        fused, one block at a time, so memory never holds two full copies; the reference is unusable afterwards.
        With `device`, each tensor moves there as it is taken (a reference built in host memory); `place_block`
        and `stream_blocks` as for `from_pretrained`."""
        params = dict(reference.named_parameters())
        device = torch.device(device) if device is not None else next(iter(params.values())).device

        def read(key):
            param = params[key]
            tensor = param.data.to(device)
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            return tensor

        return cls.from_tensors(dict(reference.config), read, device, adaln_timesteps, checkpoint_tensor, place_block,
                                stream_blocks, **switches)

    @classmethod
    def from_tensors(cls, config: dict, read, device, adaln_timesteps=None, checkpoint_tensor=None, place_block=None,
                     stream_blocks=0, **switches):
        """Build from a diffusers config and `read(key)`, which gives each diffusers tensor on `device` as it is
        needed (a reference module, weights made on the fly); the rest as for `from_pretrained`."""
        if checkpoint_tensor is not None:
            def given(key):
                return checkpoint_tensor(key, read(key))
        return cls._assemble(H3DiTConfig.from_dict(config), switches, device,
                             read if checkpoint_tensor is None else given, adaln_timesteps, place_block, stream_blocks)

    @classmethod
    def _assemble(cls, config, switches, device, read, adaln_timesteps, place_block, stream_blocks):
        with torch.device("meta"):
            model = cls(config, **switches)
        model.stream_blocks(stream_blocks, device)
        streamer = model.streamer

        def place(index, block):
            if place_block is not None:
                place_block(index, block)
            if streamer is not None and index in streamer.streamed:
                streamer.take(index)

        model._load(read, adaln_timesteps, place)
        return model

    @torch.no_grad()
    def _load(self, read, adaln_timesteps, place_block=None):
        """The weights through `read`, the blocks one at a time: `place_block(index, block)` sees each block as soon
        as it holds its weights (to quantize it, or to move it to host memory) before the next one is read, so the
        device never holds more than one block beyond what stays there."""
        skip_adaln = adaln_timesteps is not None
        wanted = [key for key in self.state_dict() if not (skip_adaln and ".adaln_proj." in key)]
        outside = self.load_state_dict({key: fuse(key, read) for key in wanted
                                        if not key.startswith("transformer_blocks.")}, assign=True, strict=False)
        missing = [key for key in outside.missing_keys if not key.startswith("transformer_blocks.")]
        if missing:
            raise KeyError(f"no weights for {missing}")
        for index, block in enumerate(self.transformer_blocks):
            prefix = f"transformer_blocks.{index}."
            block.load_state_dict({key[len(prefix):]: fuse(key, read) for key in wanted if key.startswith(prefix)},
                                  assign=True, strict=not skip_adaln)
            if place_block is not None:
                place_block(index, block)
        self.requires_grad_(False)
        device = self.proj_in.weight.device
        self.register_buffer("rope_inv_freq", rotary_inv_freq(self.config.rope_freq_dim, self.config.rope_theta)
                             .to(device), persistent=False)
        if skip_adaln:
            def adaln_weights(index):
                prefix = f"transformer_blocks.{index}.adaln_proj."
                return fuse(prefix + "weight", read), fuse(prefix + "bias", read)
            self._build_adaln_tables(adaln_timesteps, adaln_weights)
            for block in self.transformer_blocks:
                block.adaln_proj = None

    @torch.no_grad()
    def precompute_adaln(self, timesteps, drop_weights=True):
        """Build every block's modulation rows for `timesteps` (all values a run's schedules will use, or a tuple of
        such groups, each built in its own batch); with `drop_weights`, free the `adaln_proj` weights (about 13 B of
        the 33 B parameters at full size)."""
        if self.transformer_blocks[0].adaln_proj is None:
            missing = self._missing_timesteps(torch.cat([torch.as_tensor(group, dtype=torch.float32).flatten()
                                                         for group in adaln_value_groups(timesteps)]))
            if missing:
                raise ValueError(f"adaln_proj weights were already dropped; cannot add timesteps {missing}")
            return
        self._build_adaln_tables(timesteps, lambda i: (self.transformer_blocks[i].adaln_proj.weight,
                                                        self.transformer_blocks[i].adaln_proj.bias))
        if drop_weights:
            for block in self.transformer_blocks:
                block.adaln_proj = None

    def _build_adaln_tables(self, timesteps, adaln_weights):
        device = self.proj_in.weight.device
        # Each group is embedded and projected in a batch of its own: a GEMM's rounding can depend on its row count,
        # so a group holding exactly one forward's `timestep` (its distinct values, sorted) gets the very rows the
        # reference computes in that forward, and adding a group never changes the rows of another.
        groups = [torch.unique(torch.as_tensor(group, dtype=torch.float32).flatten()).to(device)
                  for group in adaln_value_groups(timesteps)]
        tembs = [self.time_embedder(values) for values in groups]
        for index, block in enumerate(self.transformer_blocks):
            weight, bias = adaln_weights(index)
            block.adaln_table = torch.cat([block.adaln_rows(temb, weight, bias) for temb in tembs])
            del weight, bias
        self.adaln_timesteps = torch.cat(groups)
        offsets = torch.tensor([0] + [len(group) for group in groups]).cumsum(0)
        self.adaln_groups = {tuple(group.tolist()): int(offset) for group, offset in zip(groups, offsets)}

    def _missing_timesteps(self, timestep):
        if self.adaln_timesteps is None:
            return timestep.tolist()
        distance = (timestep.to(self.adaln_timesteps.device)[:, None] - self.adaln_timesteps[None, :]).abs()
        return timestep[(distance.min(dim=1).values > ADALN_TIMESTEP_TOLERANCE).cpu()].tolist()

    def adaln_index(self, timestep, timestep_indices, token_tags):
        """Per packed row: its row in the modulation tensor, and whether that tensor is the precomputed table."""
        weights_present = self.transformer_blocks[0].adaln_proj is not None
        if self.adaln_table and self.adaln_timesteps is not None:
            offset = self.adaln_groups.get(tuple(timestep.float().tolist()))
            if offset is not None:  # the group built for this very forward
                return (offset + timestep_indices) * MODALITIES + token_tags, True
            distance = (timestep.float()[:, None] - self.adaln_timesteps[None, :]).abs()
            best, value_index = distance.min(dim=1)
            if bool((best <= ADALN_TIMESTEP_TOLERANCE).all()):
                return value_index[timestep_indices] * MODALITIES + token_tags, True
            if not weights_present:
                raise ValueError(
                    f"timesteps {self._missing_timesteps(timestep.float())} are not in the AdaLN table (built for "
                    f"{self.adaln_timesteps.tolist()}) and the adaln_proj weights were dropped; pass every value the "
                    "sigma schedules will use to precompute_adaln")
        if not weights_present:
            raise ValueError("adaln_proj weights were dropped by precompute_adaln; use adaln_table=True")
        return timestep_indices * MODALITIES + token_tags, False

    def refine_text(self, text):
        for block in self.token_refiner.refiner_blocks:
            text = block(text)
        final = self.token_refiner.final_norm
        return self.ops.rmsnorm_modulate(text, final.weight, final.eps)

    @torch.no_grad()
    def forward(self, hidden_states, audio_hidden_states, encoder_hidden_states, timestep, timestep_indices,
                token_tags, position_ids, video_indices, audio_indices, text_indices, step_cache=None):
        """Same inputs as diffusers' `MiniMaxH3Transformer3DModel.forward`; returns (video_velocity, audio_velocity).
        `step_cache` (h3gen.stages.cache.StepCache) may skip the middle blocks of this forward."""
        if position_ids.ndim != 2 or position_ids.shape[-1] != 3:
            raise ValueError(f"position_ids must be (seq_len, 3), got {list(position_ids.shape)}")
        seq_len = position_ids.shape[0]
        if token_tags.shape != (seq_len,) or timestep_indices.shape != (seq_len,):
            raise ValueError(f"token_tags {list(token_tags.shape)} and timestep_indices "
                             f"{list(timestep_indices.shape)} must both be ({seq_len},)")
        cos, sin = rotary_angles(position_ids, self.rope_inv_freq)

        video = self.proj_in(hidden_states.to(self.proj_in.weight.dtype))
        audio = self.audio_proj_in(audio_hidden_states.to(self.audio_proj_in.weight.dtype))
        text = self.refine_text(self.context_embedder(encoder_hidden_states.to(self.context_embedder.weight.dtype)))
        # The text stream sets the dtype of the packed sequence.
        packed = text.new_zeros((text.shape[0], seq_len, text.shape[-1]))
        packed = packed.index_copy(1, text_indices, text)
        packed = packed.index_copy(1, video_indices, video.to(text.dtype))
        packed = packed.index_copy(1, audio_indices, audio.to(text.dtype))
        del video, audio, text  # the fp32 video rows alone are 1.6 GB at the 10 s clip

        temb = self.time_embedder(timestep)
        adaln_index, from_table = self.adaln_index(timestep, timestep_indices, token_tags)
        if step_cache is not None:
            step_cache.next_forward()
        packed = self.run_blocks(packed, temb, adaln_index, from_table, cos, sin, step_cache, token_tags)

        packed = self.norm_out(packed, temb, timestep_indices, self.ops)
        video_out = self.proj_out(packed.index_select(1, video_indices).to(self.proj_out.weight.dtype))
        audio_out = self.audio_proj_out(packed.index_select(1, audio_indices).to(self.audio_proj_out.weight.dtype))
        return video_out, audio_out

    def run_blocks(self, packed, temb, adaln_index, from_table, cos, sin, step_cache=None, token_tags=None):
        """The transformer blocks over the packed rows. Everything but attention is row-wise (each row carries its
        AdaLN index, rotary angles and modality tag), so a sequence-parallel form can run this over a slice of the
        rows. With `step_cache`, the middle blocks may give way to the residual they added last time."""
        blocks, streamer = self.transformer_blocks, self.streamer

        def run(indices, packed):
            for index in indices:
                block = blocks[index]
                if streamer is not None:
                    streamer.before(index)
                modulation = block.adaln_table if from_table else block.adaln_rows(temb)
                packed = block(packed, modulation, adaln_index, cos, sin)
                if streamer is not None:
                    streamer.after(index)
            return packed

        if step_cache is None:
            return run(range(len(blocks)), packed)
        first, last = step_cache.first_blocks, len(blocks) - step_cache.last_blocks
        if first >= last:
            from h3gen.errors import UsageError

            raise UsageError(f"cache.first_blocks + cache.last_blocks ({first + step_cache.last_blocks}) leave no "
                             f"middle block of this DiT's {len(blocks)} to reuse", "lower them in the [cache] section")
        with step_cache.checking():
            entry = packed.clone()  # the blocks may write their input in place
        packed = run(range(first), packed)
        with step_cache.checking():
            reuse = step_cache.reuse(packed - entry, token_tags)
            if reuse:
                packed = packed + step_cache.middle
            else:
                middle_entry = packed.clone()
        if not reuse:
            packed = run(range(first, last), packed)
            with step_cache.checking():
                step_cache.keep(packed - middle_entry)
        return run(range(last, len(blocks)), packed)

    def stream_blocks(self, count: int, device=None) -> None:
        """Keep the last `count` blocks' weights in host memory, each brought to the device only while it runs
        (h3gen.models.dit.streaming); 0 keeps every block resident. Blocks already loaded move to host memory now;
        while loading (`from_pretrained`'s `stream_blocks`), each moves as it arrives."""
        from h3gen.models.dit.streaming import BlockStreamer

        blocks = self.transformer_blocks
        count = max(0, min(count, len(blocks)))
        device = device if device is not None else self.proj_in.weight.device
        self.streamer = BlockStreamer(blocks, list(range(len(blocks) - count, len(blocks))), device) if count else None
        if self.streamer is not None and self.proj_in.weight.device.type != "meta":
            for index in self.streamer.streamed:
                self.streamer.take(index)

    def attention_used(self):
        """The backend the blocks run, with the reason when it is not the one asked for."""
        # The blocks' dtype (proj_in is one of the checkpoint's fp32 modules).
        return choose_backend(self.proj_in.weight.device, self.attention_backend, self.context_embedder.weight.dtype,
                              self.config.attention_head_dim).describe()

    def resident_bytes(self):
        tensors = [*self.parameters(), *self.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)
