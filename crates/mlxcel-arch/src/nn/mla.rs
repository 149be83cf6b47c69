//! Multi-head latent attention (DeepSeek V2/V3): keys and values are compressed into one
//! `kv_lora_rank`-wide latent per position plus a small roped key part shared by all heads, and
//! that pair is what the cache keeps ([`LayerCache::Latent`]). The per-head key and value
//! up-projections (`kv_b_proj`, split into `embed_q` and `unembed_out`) are absorbed into the
//! query and the output instead of expanding the cache: `q_nope · (W_uk c)` = `(q_nope W_uk) · c`,
//! so attention runs against the latents directly.

use mlxcel_core::{Array, Dtype};

use super::{Linear, LinearInput, Norm, RotaryEmbedding};
use crate::cache::LayerCache;
use crate::Result;

/// How queries are projected: directly, or through a low-rank bottleneck with its own norm.
#[derive(Debug, Clone)]
pub enum QueryProjection {
    /// `q_proj`: hidden → `heads * (qk_nope + qk_rope)` (no `q_lora_rank` in the config).
    Direct(Linear),
    /// `q_a_proj` → `q_a_layernorm` → `q_b_proj` (`q_lora_rank` set).
    LowRank {
        /// `q_a_proj`: hidden → `q_lora_rank`.
        a: Linear,
        /// `q_a_layernorm`.
        norm: Norm,
        /// `q_b_proj`: `q_lora_rank` → `heads * (qk_nope + qk_rope)`.
        b: Linear,
    },
}

/// The dimensions of one latent attention layer.
#[derive(Debug, Clone, Copy)]
pub struct LatentDims {
    /// Query heads (`num_attention_heads`).
    pub heads: i32,
    /// Width of the compressed key/value latent (`kv_lora_rank`).
    pub kv_lora_rank: i32,
    /// Per-head query/key features without rope (`qk_nope_head_dim`).
    pub qk_nope: i32,
    /// Per-head query/key features with rope, the key part shared by all heads
    /// (`qk_rope_head_dim`).
    pub qk_rope: i32,
    /// Per-head value width (`v_head_dim`).
    pub v_head: i32,
}

/// Multi-head latent attention (DeepSeek V2/V3): keys and values are cached as one compressed
/// latent per position plus a shared rope key, and attention runs in latent space (the
/// per-head key/value up-projections are absorbed into `embed_q` and `unembed_out`).
#[derive(Debug, Clone)]
pub struct LatentAttention {
    /// The query projection.
    pub q: QueryProjection,
    /// hidden → `[latent | k_pe]`.
    pub kv_a: Linear,
    /// `kv_a_layernorm`, over the latent part.
    pub kv_a_norm: Norm,
    /// `[heads, kv_lora_rank, qk_nope]`: maps a head's non-rotary query into latent space.
    pub embed_q: Array,
    /// `[heads, v_head, kv_lora_rank]`: maps a head's attended latent to its value space.
    pub unembed_out: Array,
    /// `o_proj`: `heads * v_head` → hidden.
    pub o: Linear,
    /// The rotary embedding of the `qk_rope` features.
    pub rope: RotaryEmbedding,
    /// The layer's widths.
    pub dims: LatentDims,
    /// Multiplies the attention scores (`1/sqrt(qk_nope + qk_rope)`, times the YaRN mscale²
    /// when scaled).
    pub scale: f32,
}

impl LatentAttention {
    /// `residual + attention(norm(x))` for `x` `[B, L, hidden]`, extending the latent `cache`.
    pub fn forward(
        &self,
        x: &Array,
        norm: Option<&Norm>,
        residual: Option<&Array>,
        cache: &mut LayerCache,
        positions: Option<&Array>,
    ) -> Result<Array> {
        let shape = x.shape();
        let (b, l) = (shape[0], shape[1]);
        let d = self.dims;
        let input = norm.map_or(LinearInput::Plain, LinearInput::Normed);
        let q = match &self.q {
            QueryProjection::Direct(q) => q.forward_fused(x, input, None)?,
            QueryProjection::LowRank { a, norm, b } => {
                b.forward(&norm.forward(&a.forward_fused(x, input, None)?)?)?
            }
        };
        let q = q
            .reshape(&[b, l, d.heads, d.qk_nope + d.qk_rope])?
            .transpose(&[0, 2, 1, 3])?;
        let q_parts = q.split_at(&[d.qk_nope], -1)?;
        let (q_nope, q_pe) = (&q_parts[0], &q_parts[1]);
        let kv = self.kv_a.forward_fused(x, input, None)?;
        let kv_parts = kv.split_at(&[d.kv_lora_rank], -1)?;
        let latent = self
            .kv_a_norm
            .forward(&kv_parts[0])?
            .reshape(&[b, 1, l, d.kv_lora_rank])?;
        let k_pe = kv_parts[1].reshape(&[b, 1, l, d.qk_rope])?;
        let offset = cache.offset();
        let q_pe = self.rope.rotate(q_pe, positions, offset)?;
        let k_pe = self.rope.rotate(&k_pe, positions, offset)?;
        let (latents, k_pes, mask) = cache.update_latent(&latent, &k_pe)?;
        // Scores of every head against the shared latents: the absorbed non-rotary part plus
        // the rotary part, [B, H, L, S].
        let q_latent = q_nope.matmul(&self.embed_q.transpose(&[0, 2, 1])?)?;
        let scores = q_latent
            .matmul(&latents.transpose(&[0, 1, 3, 2])?)?
            .add(&q_pe.matmul(&k_pes.transpose(&[0, 1, 3, 2])?)?)?
            .mul_scalar(self.scale as f64)?;
        let scores = mask.hide(&scores)?;
        let dtype = x.dtype()?;
        let probs = scores
            .astype(Dtype::Float32)?
            .softmax(&[-1], true)?
            .astype(dtype)?;
        // [B, H, L, rank] → each head's values [B, H, L, v].
        let out = probs
            .matmul(&latents)?
            .matmul(&self.unembed_out.transpose(&[0, 2, 1])?)?;
        let out = out
            .transpose(&[0, 2, 1, 3])?
            .reshape(&[b, l, d.heads * d.v_head])?;
        self.o.forward_fused(&out, LinearInput::Plain, residual)
    }
}
