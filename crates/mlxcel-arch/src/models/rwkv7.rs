//! RWKV-7 ("Goose"): an attention-free stack of time-mixing and channel-mixing blocks. transformers
//! has no RWKV-7, so mlx-lm's `rwkv7.py` is the reference; checkpoints come in fla-hub's layout
//! (`model_type: rwkv7`, `k_k`/`k_a`/`g_norm.*` flat over the hidden size, `x_*` as
//! `[1, 1, hidden]`) or mlx-lm's (those reshaped to `[heads, head_dim]`); the sanitiser brings both
//! to one.
//!
//! Each time-mixing block mixes every input with the previous position's (the *token shift*),
//! projects receptance `r`, key `k` and value `v`, and runs the generalised delta rule per head —
//! a `head_dim × head_dim` state with a data-dependent per-channel decay `w` and an in-context
//! learning rate that removes `kk` along `kk · iclr`:
//!
//! ```text
//! S_t = S_{t-1} · diag(w_t) − (S_{t-1} kk_t)(kk_t ⊙ iclr_t)ᵀ + v_t k_tᵀ,   y_t = S_t r_t
//! ```
//!
//! then a per-head LayerNorm, a `(r · k · r_k) v` bonus term and a sigmoid-LoRA output gate. The
//! first layer's values are mixed into every later layer's (`v_first`). The channel-mixing block
//! is a token-shifted squared-ReLU MLP.
//!
//! Each layer's [`LayerCache::State`] holds three arrays: the time mixer's last input (the token
//! shift), its state (float32) and the channel mixer's last input. On the CPU with mlxcel's
//! kernels on, a prefill chunk's recurrence is one call of the CPU delta-rule kernel
//! (`ops::cpu_delta_rule_scan`, position after position per head over the thread pool);
//! otherwise it runs position by position inside one graph (mlx-lm's path does the same; a
//! chunked matrix form of the generalised delta rule is future work). Either way it continues
//! from the cached state, so any split of a prompt gives the state of one pass.

use mlxcel_core::{ops, Array, Dtype, WeightMap};
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::transformer::check_token_ids;
use crate::cache::LayerCache;
use crate::model::{Architecture, LanguageModel, LayerKind};
use crate::nn::{Embedding, Linear, LinearInput, Norm, NormKind};
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

fn default_eps() -> f32 {
    1e-5
}
fn default_head_dim() -> i32 {
    64
}

/// The `config.json` keys of RWKV-7 (fla-hub's `RWKV7Config`, as mlx-lm reads them).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// `vocab_size`.
    pub vocab_size: i32,
    /// `hidden_size`: the model width, `heads × head_dim`.
    pub hidden_size: i32,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `intermediate_size`: the channel mixer's width; default `4 · hidden_size`.
    #[serde(default)]
    pub intermediate_size: Option<i32>,
    /// `head_dim`: default 64.
    #[serde(default = "default_head_dim")]
    pub head_dim: i32,
    /// `norm_eps`: the LayerNorms' epsilon; default 1e-5.
    #[serde(default = "default_eps")]
    pub norm_eps: f32,
    /// `decay_low_rank_dim`: rank of the decay LoRA (required).
    pub decay_low_rank_dim: i32,
    /// `a_low_rank_dim`: rank of the in-context learning-rate LoRA (required).
    pub a_low_rank_dim: i32,
    /// `v_low_rank_dim`: rank of the value-mixing LoRA (required).
    pub v_low_rank_dim: i32,
    /// `gate_low_rank_dim`: rank of the output-gate LoRA (required).
    pub gate_low_rank_dim: i32,
    /// `tie_word_embeddings`: default false.
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

impl Args {
    fn heads(&self) -> Result<i32> {
        for (key, v) in [
            ("hidden_size", self.hidden_size),
            ("head_dim", self.head_dim),
            ("decay_low_rank_dim", self.decay_low_rank_dim),
            ("a_low_rank_dim", self.a_low_rank_dim),
            ("v_low_rank_dim", self.v_low_rank_dim),
            ("gate_low_rank_dim", self.gate_low_rank_dim),
        ] {
            if v <= 0 {
                return Err(ModelError::Config(format!("{key} = {v}: must be positive")));
            }
        }
        if self.hidden_size % self.head_dim != 0 {
            return Err(ModelError::Config(format!(
                "hidden_size {} is not a multiple of head_dim {}",
                self.hidden_size, self.head_dim
            )));
        }
        Ok(self.hidden_size / self.head_dim)
    }

    fn intermediate(&self) -> i32 {
        self.intermediate_size.unwrap_or(4 * self.hidden_size)
    }
}

/// The activation between a low-rank adapter's two projections.
#[derive(Debug, Clone, Copy)]
enum LoraAct {
    Tanh,
    Sigmoid,
    Identity,
}

/// A low-rank bottleneck `up(act(down(x)))` (`lora.0`, `lora.2`).
#[derive(Debug)]
struct LowRank {
    down: Linear,
    up: Linear,
    act: LoraAct,
}

impl LowRank {
    fn load(
        w: &mut ModelWeights,
        name: &str,
        dims: (i32, i32),
        act: LoraAct,
        bias: bool,
    ) -> Result<LowRank> {
        let (hidden, rank) = dims;
        let mut s = w.scope(format!("{name}.lora"));
        Ok(LowRank {
            down: s.linear("0", hidden, rank, false)?,
            up: s.linear("2", rank, hidden, bias)?,
            act,
        })
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        let h = self.down.forward(x)?;
        let h = match self.act {
            LoraAct::Tanh => h.tanh()?,
            LoraAct::Sigmoid => h.sigmoid()?,
            LoraAct::Identity => h,
        };
        self.up.forward(&h)
    }
}

/// `x` `[B, L, D]` shifted one position back, the first row from `previous` `[B, 1, D]` (zeros
/// before the first token).
fn token_shift(x: &Array, previous: Option<&Array>) -> Result<Array> {
    let (b, l, d) = (x.dim(0)?, x.dim(1)?, x.dim(2)?);
    let previous = match previous {
        Some(p) => p.astype(x.dtype()?)?,
        None => ops::zeros(&[b, 1, d], x.dtype()?)?,
    };
    if l == 1 {
        return Ok(previous);
    }
    Ok(ops::concatenate(
        &[previous, x.slice_axis(1, 0, l - 1)?],
        1,
    )?)
}

/// `x + (shifted - x) · mix`.
fn lerp(x: &Array, delta: &Array, mix: &Array) -> Result<Array> {
    Ok(x.add(&delta.multiply(mix)?)?)
}

/// The time-mixing block (`attn.*`).
#[derive(Debug)]
struct TimeMix {
    /// Token-shift mixing coefficients of r, w, k, v, a, g (`x_r` … `x_g`), `[hidden]` each.
    mix: [Array; 6],
    /// `k_k`, `k_a`, `r_k`: `[heads, head_dim]`.
    k_k: Array,
    k_a: Array,
    r_k: Array,
    r_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    g_norm: Norm,
    w_lora: LowRank,
    a_lora: LowRank,
    g_lora: LowRank,
    /// Layer 0 has none: its values are `v_first`.
    v_lora: Option<LowRank>,
    heads: i32,
    head_dim: i32,
}

/// `x / max(|x|, 1e-7)` over the last axis (mlx-lm's `l2_norm`).
fn l2_normalize(x: &Array) -> Result<Array> {
    let norm = x.square()?.sum(&[-1], true)?.sqrt()?;
    Ok(x.divide(&norm.maximum(&norm.scalar_like(1e-7)?)?)?)
}

impl TimeMix {
    /// The generalised delta rule over `L` positions of `r`, `w`, `k`, `v`, `a`, `b`
    /// `[B, L, H, D]` (float32) from `state` `[B, H, D(v), D(k)]`: `y` `[B, L, H, D]` and the last
    /// state.
    fn scan(
        r: &Array,
        w: &Array,
        k: &Array,
        v: &Array,
        a: &Array,
        b: &Array,
        mut state: Array,
    ) -> Result<(Array, Array)> {
        // mlxcel's CPU kernel runs the whole prompt in one call (the graph below is one set of
        // ops per position).
        if let Some(scanned) = ops::cpu_delta_rule_scan(r, w, k, v, a, b, &state)? {
            return Ok(scanned);
        }
        let l = r.dim(1)?;
        let at =
            |x: &Array, t: i32| -> Result<Array> { Ok(x.slice_axis(1, t, t + 1)?.squeeze(&[1])?) };
        let mut ys = Vec::with_capacity(l as usize);
        for t in 0..l {
            let (r, w, k, v, a, b) = (
                at(r, t)?,
                at(w, t)?,
                at(k, t)?,
                at(v, t)?,
                at(a, t)?,
                at(b, t)?,
            );
            // [B, H, Dv, 1] @ [B, H, 1, Dk]: the removal along kk, from the previous state.
            let removal = state
                .matmul(&a.expand_dims(&[-1])?)?
                .matmul(&b.expand_dims(&[-2])?)?;
            let write = v.expand_dims(&[-1])?.matmul(&k.expand_dims(&[-2])?)?;
            state = state
                .multiply(&w.expand_dims(&[-2])?)?
                .add(&write)?
                .add(&removal)?;
            ys.push(state.matmul(&r.expand_dims(&[-1])?)?.squeeze(&[-1])?);
        }
        Ok((ops::stack(&ys, 1)?, state))
    }

    /// `x` `[B, L, hidden]` (normed) → the block's output, and this layer's values (`v_first`
    /// for layer 0). `shift` and `state` are the cached token shift and recurrent state.
    fn forward(
        &self,
        x: &Array,
        v_first: Option<&Array>,
        shift: Option<&Array>,
        state: Option<Array>,
    ) -> Result<(Array, Array, Array)> {
        let (bsz, l) = (x.dim(0)?, x.dim(1)?);
        let (h, d) = (self.heads, self.head_dim);
        let dtype = x.dtype()?;
        let delta = token_shift(x, shift)?.subtract(x)?;
        let [xr, xw, xk, xv, xa, xg] = [0, 1, 2, 3, 4, 5].map(|i| lerp(x, &delta, &self.mix[i]));
        let heads = |a: Array| -> Result<Array> { Ok(a.reshape(&[bsz, l, h, d])?) };
        let key = heads(self.k_proj.forward(&xk?)?)?;
        let xv = xv?;
        let mut value = heads(self.v_proj.forward(&xv)?)?;
        let receptance = heads(self.r_proj.forward(&xr?)?)?;
        let iclr = heads(self.a_lora.forward(&xa?)?.sigmoid()?)?;
        let gate = self.g_lora.forward(&xg?)?;
        match (&self.v_lora, v_first) {
            (Some(v_lora), Some(first)) => {
                let mix = heads(v_lora.forward(&xv)?.sigmoid()?)?;
                value = lerp(&value, &first.subtract(&value)?, &mix)?;
            }
            (None, _) => {}
            (Some(_), None) => {
                return Err(ModelError::Runtime(
                    "internal: an RWKV-7 layer after the first ran without v_first".into(),
                ))
            }
        }
        let f32 = |a: &Array| a.astype(Dtype::Float32);
        // Per-channel decay e^{-0.606531 · sigmoid(·)} ∈ (e^{-0.61}, 1).
        let decay = heads(self.w_lora.forward(&xw?)?)?;
        let decay = f32(&decay)?.sigmoid()?.mul_scalar(-0.606531)?.exp()?;
        let kk = l2_normalize(&key.multiply(&self.k_k)?)?;
        let one = iclr.scalar_like(1.0)?;
        let key = key.multiply(&one.add(&iclr.subtract(&one)?.multiply(&self.k_a)?)?)?;
        let a = kk.negative()?;
        let b = kk.multiply(&iclr)?;
        let state = match state {
            Some(s) => s,
            None => ops::zeros(&[bsz, h, d, d], Dtype::Float32)?,
        };
        let (y, state) = Self::scan(
            &f32(&receptance)?,
            &decay,
            &f32(&key)?,
            &f32(&value)?,
            &f32(&a)?,
            &f32(&b)?,
            state,
        )?;
        let y = self.g_norm.forward(&y.astype(dtype)?)?;
        let bonus = receptance
            .multiply(&key)?
            .multiply(&self.r_k)?
            .sum(&[-1], true)?
            .multiply(&value)?;
        let out = y.add(&bonus)?.reshape(&[bsz, l, h * d])?;
        let out = self.o_proj.forward(&out.multiply(&gate)?)?;
        Ok((out, value, state))
    }
}

/// The channel-mixing block (`ffn.*`): `value(relu(key(lerp(x, shifted, x_k)))²)`.
#[derive(Debug)]
struct ChannelMix {
    x_k: Array,
    key: Linear,
    value: Linear,
}

impl ChannelMix {
    fn forward(&self, x: &Array, shift: Option<&Array>) -> Result<Array> {
        let delta = token_shift(x, shift)?.subtract(x)?;
        let k = self.key.forward(&lerp(x, &delta, &self.x_k)?)?;
        let k = k.maximum(&k.scalar_like(0.0)?)?.square()?;
        self.value.forward(&k)
    }
}

#[derive(Debug)]
struct Block {
    /// Layer 0 normalises the embeddings first.
    pre_norm: Option<Norm>,
    attn_norm: Norm,
    ffn_norm: Norm,
    attn: TimeMix,
    ffn: ChannelMix,
}

/// The RWKV-7 model.
#[derive(Debug)]
pub struct Model {
    embed: Embedding,
    blocks: Vec<Block>,
    norm: Norm,
    lm_head: Option<Linear>,
    vocab: usize,
    schedule: Vec<LayerKind>,
}

/// The cached `(time shift, state, channel shift)` of a layer, `None`s before the first token.
fn read_layer_state(cache: &LayerCache) -> Result<[Option<Array>; 3]> {
    match cache {
        LayerCache::State(s) => {
            let get = |i: usize| s.arrays.get(i).cloned().flatten();
            Ok([get(0), get(1), get(2)])
        }
        other => Err(ModelError::Runtime(format!(
            "an RWKV-7 layer was given a cache at position {} that is not a state cache (caches must come from the model's make_caches)",
            other.offset()
        ))),
    }
}

fn schedule(args: &Args) -> Result<Vec<LayerKind>> {
    let heads = args.heads()?;
    let kind = LayerKind::Recurrent {
        // The two token shifts: one row each of the time and channel mixers' inputs.
        window: 2 * args.hidden_size as u64,
        state: (heads * args.head_dim * args.head_dim) as u64,
    };
    Ok(vec![kind; args.num_hidden_layers])
}

impl Architecture for Model {
    type Args = Args;

    /// fla-hub's flat `k_k`, `k_a`, `g_norm.*` become `[heads, head_dim]` (as mlx-lm's
    /// conversions store them), and the `x_*` mixing coefficients plain `[hidden]` vectors.
    fn sanitize(args: &Args, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        let heads = args.heads()?;
        let names: Vec<String> = weights.names().map(str::to_string).collect();
        for name in names {
            let leaf = name.rsplit('.').next().unwrap_or_default();
            let per_head = matches!(leaf, "k_k" | "k_a")
                || (name.contains(".attn.g_norm.") && matches!(leaf, "weight" | "bias"));
            let mixing = leaf.starts_with("x_") && leaf.len() == 3;
            if per_head || mixing {
                let shape: &[i32] = if per_head {
                    &[heads, args.head_dim]
                } else {
                    &[args.hidden_size]
                };
                let t = weights.take(&name)?;
                if t.size() != (args.hidden_size as usize) {
                    return Err(ModelError::Shape {
                        tensor: name,
                        found: t.shape(),
                        expected: shape.to_vec(),
                    });
                }
                weights.insert(name, t.reshape(shape)?)?;
            }
        }
        Ok(())
    }

    fn cache_schedule(args: &Args) -> Result<Vec<LayerKind>> {
        schedule(args)
    }

    fn build(args: &Args, w: &mut ModelWeights) -> Result<Model> {
        let heads = args.heads()?;
        let (hd, d) = (args.hidden_size, args.head_dim);
        let eps = args.norm_eps;
        let mut body = w.scope("model");
        let embed = body.embedding("embeddings", args.vocab_size, hd)?;
        let mut blocks = Vec::with_capacity(args.num_hidden_layers);
        {
            let mut layers = body.scope("layers");
            for i in 0..args.num_hidden_layers {
                let mut l = layers.scope(i);
                let pre_norm = if i == 0 {
                    Some(l.norm("pre_norm", NormKind::Layer, hd, eps)?)
                } else {
                    None
                };
                let attn_norm = l.norm("attn_norm", NormKind::Layer, hd, eps)?;
                let ffn_norm = l.norm("ffn_norm", NormKind::Layer, hd, eps)?;
                let attn = {
                    let mut a = l.scope("attn");
                    let mix =
                        ["x_r", "x_w", "x_k", "x_v", "x_a", "x_g"].map(|n| a.tensor(n, &[hd]));
                    let [r, ww, k, v, aa, g] = mix;
                    let per_head = |a: &mut ModelWeights, n: &str| a.tensor(n, &[heads, d]);
                    let g_norm = Norm::new(
                        NormKind::Layer,
                        per_head(&mut a, "g_norm.weight")?,
                        Some(per_head(&mut a, "g_norm.bias")?),
                        64e-5,
                    )?;
                    TimeMix {
                        mix: [r?, ww?, k?, v?, aa?, g?],
                        k_k: per_head(&mut a, "k_k")?,
                        k_a: per_head(&mut a, "k_a")?,
                        r_k: per_head(&mut a, "r_k")?,
                        r_proj: a.linear("r_proj", hd, hd, false)?,
                        k_proj: a.linear("k_proj", hd, hd, false)?,
                        v_proj: a.linear("v_proj", hd, hd, false)?,
                        o_proj: a.linear("o_proj", hd, hd, false)?,
                        g_norm,
                        w_lora: LowRank::load(
                            &mut a,
                            "w_lora",
                            (hd, args.decay_low_rank_dim),
                            LoraAct::Tanh,
                            true,
                        )?,
                        a_lora: LowRank::load(
                            &mut a,
                            "a_lora",
                            (hd, args.a_low_rank_dim),
                            LoraAct::Identity,
                            true,
                        )?,
                        g_lora: LowRank::load(
                            &mut a,
                            "g_lora",
                            (hd, args.gate_low_rank_dim),
                            LoraAct::Sigmoid,
                            false,
                        )?,
                        v_lora: if i == 0 {
                            None
                        } else {
                            Some(LowRank::load(
                                &mut a,
                                "v_lora",
                                (hd, args.v_low_rank_dim),
                                LoraAct::Identity,
                                true,
                            )?)
                        },
                        heads,
                        head_dim: d,
                    }
                };
                let ffn = {
                    let mut f = l.scope("ffn");
                    ChannelMix {
                        x_k: f.tensor("x_k", &[hd])?,
                        key: f.linear("key", hd, args.intermediate(), false)?,
                        value: f.linear("value", args.intermediate(), hd, false)?,
                    }
                };
                blocks.push(Block {
                    pre_norm,
                    attn_norm,
                    ffn_norm,
                    attn,
                    ffn,
                });
            }
        }
        let norm = body.norm("norm", NormKind::Layer, hd, eps)?;
        drop(body);
        let lm_head = if args.tie_word_embeddings && !w.contains("lm_head.weight") {
            None
        } else {
            Some(w.linear("lm_head", hd, args.vocab_size, false)?)
        };
        Ok(Model {
            embed,
            blocks,
            norm,
            lm_head,
            vocab: args.vocab_size as usize,
            schedule: schedule(args)?,
        })
    }
}

impl Model {
    fn body(&self, mut x: Array, caches: &mut [LayerCache]) -> Result<Array> {
        if caches.len() != self.blocks.len() {
            return Err(ModelError::Runtime(format!(
                "{} caches for {} layers",
                caches.len(),
                self.blocks.len()
            )));
        }
        let l = x.dim(1)?;
        let mut v_first: Option<Array> = None;
        for (block, cache) in self.blocks.iter().zip(caches.iter_mut()) {
            let [time_shift, state, channel_shift] = read_layer_state(cache)?;
            if let Some(n) = &block.pre_norm {
                x = n.forward(&x)?;
            }
            let xa = block.attn_norm.forward(&x)?;
            let (out, value, state) =
                block
                    .attn
                    .forward(&xa, v_first.as_ref(), time_shift.as_ref(), state)?;
            v_first.get_or_insert(value);
            x = x.add(&out)?;
            let xf = block.ffn_norm.forward(&x)?;
            x = x.add(&block.ffn.forward(&xf, channel_shift.as_ref())?)?;
            if let LayerCache::State(s) = cache {
                let last = |a: &Array| a.slice_axis(1, l - 1, l);
                s.arrays = vec![Some(last(&xa)?), Some(state), Some(last(&xf)?)];
                s.advance(l as usize);
            }
        }
        Ok(x)
    }
}

impl LanguageModel for Model {
    fn embed(&self, tokens: &Array) -> Result<Array> {
        check_token_ids(tokens, self.vocab)?;
        self.embed.forward(tokens)
    }

    fn forward_embeddings(
        &self,
        embeddings: &Array,
        _positions: Option<&Array>,
        caches: &mut [LayerCache],
        last_only: bool,
    ) -> Result<Array> {
        let h = self.body(embeddings.clone(), caches)?;
        let h = if last_only {
            let n = h.dim(1)?;
            h.slice_axis(1, n - 1, n)?
        } else {
            h
        };
        match &self.lm_head {
            Some(head) => head.forward_fused(&h, LinearInput::Normed(&self.norm), None),
            None => self.embed.as_linear(&self.norm.forward(&h)?),
        }
    }

    fn final_hidden_states(&self, embeddings: &Array, caches: &mut [LayerCache]) -> Result<Array> {
        let h = self.body(embeddings.clone(), caches)?;
        self.norm.forward(&h)
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn layer_schedule(&self) -> Vec<LayerKind> {
        self.schedule.clone()
    }
}
