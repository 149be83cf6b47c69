//! Normalisation layers.

use mlxcel_core::Array;

use crate::Result;

/// Which normalisation and how its weight is applied.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum NormKind {
    /// RMSNorm scaled by `w`.
    Rms,
    /// RMSNorm scaled by `1 + w` (Gemma stores the offset from one).
    RmsOffset,
    /// LayerNorm with weight and optional bias.
    Layer,
}

/// A normalisation layer over the last axis (`[.., dim]` → `[.., dim]`).
#[derive(Debug, Clone)]
pub struct Norm {
    kind: NormKind,
    weight: Array,
    bias: Option<Array>,
    eps: f32,
}

impl Norm {
    /// A norm of `kind` with `weight` `[dim]` (and `bias` `[dim]` for a LayerNorm); `eps` from
    /// the config (`rms_norm_eps` / `layer_norm_eps`). For [`NormKind::RmsOffset`] the `1 + w`
    /// is folded in here.
    pub fn new(kind: NormKind, weight: Array, bias: Option<Array>, eps: f32) -> Result<Norm> {
        // Fold Gemma's `1 + w` into the stored weight once, at load.
        let weight = match kind {
            NormKind::RmsOffset => weight.add_scalar(1.0)?,
            _ => weight,
        };
        Ok(Norm {
            kind,
            weight,
            bias,
            eps,
        })
    }

    /// Normalises `x` `[.., dim]` over its last axis.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        if self.weight.ndim() > 1 {
            // A weight per head (`[heads, 1, head_dim]` against `[B, heads, L, head_dim]`): the
            // fused kernels take one vector, so normalise first and scale after.
            let y = match self.kind {
                NormKind::Rms | NormKind::RmsOffset => x.rms_norm(None, self.eps)?,
                NormKind::Layer => x.layer_norm(None, None, self.eps)?,
            };
            let y = y.multiply(&self.weight)?;
            return Ok(match &self.bias {
                Some(b) => y.add(b)?,
                None => y,
            });
        }
        Ok(match self.kind {
            NormKind::Rms | NormKind::RmsOffset => x.rms_norm(Some(&self.weight), self.eps)?,
            NormKind::Layer => x.layer_norm(Some(&self.weight), self.bias.as_ref(), self.eps)?,
        })
    }

    /// The weight and epsilon of an RMSNorm (Gemma's `1 + w` already folded in), `None` for a
    /// LayerNorm: what a GEMV kernel needs to apply the norm itself.
    pub fn rms_parts(&self) -> Option<(&Array, f32)> {
        if self.weight.ndim() > 1 {
            return None;
        }
        match self.kind {
            NormKind::Rms | NormKind::RmsOffset => Some((&self.weight, self.eps)),
            NormKind::Layer => None,
        }
    }

    /// The arrays created at load (the folded `1 + w`), for materialisation.
    pub fn arrays(&self) -> Vec<&Array> {
        vec![&self.weight]
    }
}
