//! Gated and plain MLPs.

use mlxcel_core::Array;

use super::{Linear, LinearInput, Norm};
use crate::Result;

/// Activation functions by their config names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu` / `swish`.
    Silu,
    /// `gelu_pytorch_tanh` / `gelu_new` / `gelu_fast`: the tanh approximation.
    GeluTanh,
    /// `gelu`: the exact erf form.
    Gelu,
    /// `relu`.
    Relu,
    /// `relu2`: `relu(x)²` (Nemotron-H's MLPs and experts).
    Relu2,
    /// `xielu` (Apertus): a learned activation with per-layer parameters, read from the
    /// checkpoint's `mlp.act_fn.*` when the MLP is built.
    XIelu(XIeluParams),
    /// gpt-oss's gated activation of its experts: `(clip(up, ±L) + 1) · g · sigmoid(α g)` with
    /// `g = min(gate, L)`, at the checkpoints' constants α = [`OAI_SWIGLU_ALPHA`] and
    /// L = [`OAI_SWIGLU_LIMIT`]. Gated only: never named by `hidden_act`.
    OaiSwiglu,
}

/// The parameters of xIELU (<https://arxiv.org/abs/2411.13010>) in the form the formula uses:
/// `x > 0: alpha_p·x² + beta·x`, else `(expm1(min(x, eps)) − x)·alpha_n + beta·x`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct XIeluParams {
    /// `softplus(act_fn.alpha_p)`.
    pub alpha_p: f32,
    /// `beta + softplus(act_fn.alpha_n)`.
    pub alpha_n: f32,
    /// `act_fn.beta` (0.5 in the published checkpoints).
    pub beta: f32,
    /// `act_fn.eps` (−1e-6 in the published checkpoints).
    pub eps: f32,
}

// Finite numbers read from a checkpoint: equality is reflexive.
impl Eq for XIeluParams {}

impl XIeluParams {
    /// From the stored (pre-softplus) `alpha_p`, `alpha_n` and the `beta`, `eps` buffers.
    pub fn from_stored(alpha_p: f32, alpha_n: f32, beta: f32, eps: f32) -> XIeluParams {
        let softplus = |v: f32| (v as f64).exp().ln_1p() as f32;
        XIeluParams {
            alpha_p: softplus(alpha_p),
            alpha_n: beta + softplus(alpha_n),
            beta,
            eps,
        }
    }
}

/// α of [`Activation::OaiSwiglu`] (transformers' `swiglu_alpha`).
pub const OAI_SWIGLU_ALPHA: f64 = 1.702;
/// L of [`Activation::OaiSwiglu`] (transformers' `swiglu_limit`).
pub const OAI_SWIGLU_LIMIT: f64 = 7.0;

impl Activation {
    /// The activation a config's `hidden_act` / `hidden_activation` names, `None` when unknown.
    pub fn from_name(name: &str) -> Option<Activation> {
        Some(match name {
            "silu" | "swish" => Activation::Silu,
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" | "gelu_tanh" => Activation::GeluTanh,
            "gelu" | "gelu_exact" => Activation::Gelu,
            "relu" => Activation::Relu,
            "relu2" => Activation::Relu2,
            _ => return None,
        })
    }

    /// The activations `ops::gated_activation` fuses with their multiply.
    fn fused_kind(self) -> Option<mlxcel_core::ops::GatedActivation> {
        use mlxcel_core::ops::GatedActivation;
        match self {
            Activation::Silu => Some(GatedActivation::Silu),
            Activation::GeluTanh => Some(GatedActivation::GeluTanh),
            Activation::Gelu => Some(GatedActivation::Gelu),
            Activation::Relu | Activation::Relu2 | Activation::XIelu(_) | Activation::OaiSwiglu => {
                None
            }
        }
    }

    /// `act(gate) * up`, as one fused kernel where the backend allows (see
    /// `ops::gated_activation`).
    pub fn gated(self, gate: &Array, up: &Array) -> Result<Array> {
        if let Some(kind) = self.fused_kind() {
            return Ok(mlxcel_core::ops::gated_activation(kind, gate, up)?);
        }
        if let Activation::OaiSwiglu = self {
            let limit = gate.scalar_like(OAI_SWIGLU_LIMIT)?;
            let gate = gate.clip(None, Some(&limit))?;
            let up = up.clip(Some(&up.scalar_like(-OAI_SWIGLU_LIMIT)?), Some(&limit))?;
            let glu = gate.multiply(&gate.mul_scalar(OAI_SWIGLU_ALPHA)?.sigmoid()?)?;
            return Ok(up.add_scalar(1.0)?.multiply(&glu)?);
        }
        // ReLU, ReLU² and xIELU: the activation, then the multiply.
        Ok(self.apply(gate)?.multiply(up)?)
    }

    /// [`Activation::gated`] of `x = [gate | up]` split along its last axis (a fused gate/up
    /// projection's output): the fused kinds as `ops::gated_activation_halves`.
    pub fn gated_halves(self, x: &Array) -> Result<Array> {
        if let Some(kind) = self.fused_kind() {
            return Ok(mlxcel_core::ops::gated_activation_halves(kind, x)?);
        }
        let parts = x.split_at(&[x.dim(-1)? / 2], -1)?;
        self.gated(&parts[0], &parts[1])
    }

    /// The activation applied element-wise to `x` (any shape).
    pub fn apply(self, x: &Array) -> Result<Array> {
        Ok(match self {
            Activation::Silu => x.multiply(&x.sigmoid()?)?,
            Activation::GeluTanh => {
                // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
                let inner = x
                    .add(&x.multiply(&x.square()?)?.mul_scalar(0.044715)?)?
                    .mul_scalar((2.0 / std::f64::consts::PI).sqrt())?;
                x.multiply(&inner.tanh()?.add_scalar(1.0)?)?
                    .mul_scalar(0.5)?
            }
            Activation::Gelu => {
                let e = x.mul_scalar(std::f64::consts::FRAC_1_SQRT_2)?.erf()?;
                x.multiply(&e.add_scalar(1.0)?)?.mul_scalar(0.5)?
            }
            Activation::Relu => x.maximum(&x.scalar_like(0.0)?)?,
            Activation::Relu2 => x.maximum(&x.scalar_like(0.0)?)?.square()?,
            Activation::XIelu(p) => {
                let linear = x.mul_scalar(p.beta as f64)?;
                let positive = x.square()?.mul_scalar(p.alpha_p as f64)?.add(&linear)?;
                let negative = x
                    .minimum(&x.scalar_like(p.eps as f64)?)?
                    .expm1()?
                    .subtract(x)?
                    .mul_scalar(p.alpha_n as f64)?
                    .add(&linear)?;
                let is_positive = x.greater(&x.scalar_like(0.0)?)?;
                mlxcel_core::ops::where_(&is_positive, &positive, &negative)?
            }
            Activation::OaiSwiglu => {
                return Err(crate::ModelError::Config(
                    "internal: gpt-oss's swiglu is a gated activation".into(),
                ))
            }
        })
    }
}

/// `down(act(gate(x)) * up(x))`, with the gate and up projections separate or fused
/// (`gate_up_proj`, gate first).
#[derive(Debug, Clone)]
pub enum Mlp {
    /// Separate `gate_proj`, `up_proj`, `down_proj`.
    Gated {
        /// hidden → intermediate.
        gate: Linear,
        /// hidden → intermediate.
        up: Linear,
        /// intermediate → hidden.
        down: Linear,
        /// Applied to the gate.
        act: Activation,
    },
    /// One `gate_up_proj` whose output is `[gate | up]`.
    FusedGated {
        /// model width → `[gate | up]`, `2 * hidden` wide.
        gate_up: Linear,
        /// intermediate → model hidden.
        down: Linear,
        /// Applied to the gate.
        act: Activation,
        /// The intermediate width (where `gate_up`'s output splits).
        hidden: i32,
    },
    /// `down(act(up(x)))`.
    Plain {
        /// `up_proj` (`c_fc`): hidden → intermediate.
        up: Linear,
        /// `down_proj` (`c_proj`): intermediate → hidden.
        down: Linear,
        /// Applied between the two.
        act: Activation,
    },
}

impl Mlp {
    /// `x` `[.., hidden]` → `[.., hidden]`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        self.forward_fused(x, None, None)
    }

    /// `residual + self(norm(x))`, folding the norm into the first projection and the residual
    /// add into the last where [`Linear::forward_fused`] can.
    pub fn forward_fused(
        &self,
        x: &Array,
        norm: Option<&Norm>,
        residual: Option<&Array>,
    ) -> Result<Array> {
        let input = norm.map_or(LinearInput::Plain, LinearInput::Normed);
        let normed = || -> Result<Array> {
            Ok(match norm {
                Some(n) => n.forward(x)?,
                None => x.clone(),
            })
        };
        match self {
            Mlp::Gated {
                gate,
                up,
                down,
                act,
            } => {
                let x = normed()?;
                let h = act.gated(&gate.forward(&x)?, &up.forward(&x)?)?;
                down.forward_fused(&h, LinearInput::Plain, residual)
            }
            Mlp::FusedGated {
                gate_up,
                down,
                act,
                hidden,
            } => {
                let gu = gate_up.forward_fused(x, input, None)?;
                debug_assert_eq!(gu.dim(-1)?, 2 * hidden);
                down.forward_fused(&gu, LinearInput::Gated(*act), residual)
            }
            Mlp::Plain { up, down, act } => {
                let h = act.apply(&up.forward_fused(x, input, None)?)?;
                down.forward_fused(&h, LinearInput::Plain, residual)
            }
        }
    }
}
