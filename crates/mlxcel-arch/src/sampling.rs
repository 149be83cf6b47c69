//! Next-token sampling on the host: greedy at temperature 0, else temperature, top-k, top-p,
//! min-p and repetition penalty, with a seeded generator so `--seed` reproduces a run.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sampling settings; `Default` is greedy decoding.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the `k` most likely tokens (0: off).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `p` (1: off).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` × the top probability (0: off).
    pub min_p: f32,
    /// CTRL-style penalty on tokens seen in the last `repetition_context` tokens (1: off).
    pub repetition_penalty: f32,
    /// How many of the most recent tokens the repetition penalty looks at (default 64).
    pub repetition_context: usize,
    /// Seed of the random generator: the same seed, params and logits give the same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repetition_context: 64,
            seed: 0,
        }
    }
}

/// A sampling parameter out of range: `field` is the [`SamplingParams`] field (a CLI turns it
/// into its flag), `value` as given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamError {
    /// The [`SamplingParams`] field name (e.g. `"top_p"`).
    pub field: &'static str,
    /// The value given, as text.
    pub value: String,
    /// The allowed range (e.g. `"must be in (0, 1] (1 = off)"`).
    pub reason: &'static str,
}

impl std::fmt::Display for ParamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} = {}: {}", self.field, self.value, self.reason)
    }
}

impl std::error::Error for ParamError {}

impl SamplingParams {
    /// Checks every parameter's range: temperature ≥ 0 and finite, top_p in (0, 1], min_p in
    /// [0, 1], repetition_penalty > 0 and finite (top_k is unsigned: 0 turns it off).
    pub fn validate(&self) -> Result<(), ParamError> {
        let bad = |field, value: f32, reason| {
            Err(ParamError {
                field,
                value: value.to_string(),
                reason,
            })
        };
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(
                "temperature",
                self.temperature,
                "must be finite and at least 0 (0 = greedy)",
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p, "must be in (0, 1] (1 = off)");
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return bad("min_p", self.min_p, "must be in [0, 1] (0 = off)");
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(
                "repetition_penalty",
                self.repetition_penalty,
                "must be finite and greater than 0 (1 = off)",
            );
        }
        Ok(())
    }
}

/// Picks tokens from logits per [`SamplingParams`], holding the seeded random generator so a
/// run's choices are reproducible.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    /// A sampler seeded from `params.seed` (the params are not validated here: see
    /// [`SamplingParams::validate`]).
    pub fn new(params: SamplingParams) -> Sampler {
        let rng = StdRng::seed_from_u64(params.seed);
        Sampler { params, rng }
    }

    /// Whether the choice is the plain argmax (no randomness, no history), which can then be
    /// made on the device.
    pub fn is_greedy(&self) -> bool {
        self.params.temperature <= 0.0 && self.params.repetition_penalty == 1.0
    }

    /// Picks the next token from `logits` (one row, any length) given the tokens so far.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let p = &self.params;
        let mut logits = logits.to_vec();
        if p.repetition_penalty != 1.0 {
            let start = history.len().saturating_sub(p.repetition_context);
            for &t in &history[start..] {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        let argmax = || {
            logits
                .iter()
                .enumerate()
                .fold((0usize, f32::NEG_INFINITY), |best, (i, &l)| {
                    if l > best.1 {
                        (i, l)
                    } else {
                        best
                    }
                })
                .0 as u32
        };
        if p.temperature <= 0.0 {
            return argmax();
        }
        // Candidates sorted by logit, most likely first.
        let mut order: Vec<usize> = (0..logits.len())
            .filter(|i| logits[*i].is_finite())
            .collect();
        order.sort_by(|a, b| logits[*b].total_cmp(&logits[*a]));
        if p.top_k > 0 {
            order.truncate(p.top_k);
        }
        if order.is_empty() {
            return argmax();
        }
        let max = logits[order[0]];
        let mut probs: Vec<f64> = order
            .iter()
            .map(|i| (((logits[*i] - max) / p.temperature) as f64).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= total);
        let mut keep = probs.len();
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p as f64;
            keep = probs.iter().take_while(|q| **q >= floor).count().max(1);
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut n = 0;
            for q in &probs[..keep] {
                acc += q;
                n += 1;
                if acc >= p.top_p as f64 {
                    break;
                }
            }
            keep = n.max(1);
        }
        let kept = &probs[..keep];
        let total: f64 = kept.iter().sum();
        let mut r = self.rng.gen::<f64>() * total;
        for (q, i) in kept.iter().zip(&order) {
            if r < *q {
                return *i as u32;
            }
            r -= q;
        }
        order[keep - 1] as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_filters_and_seeds() {
        let logits = [0.0f32, 3.0, 1.0, 2.9, -1.0];
        let mut greedy = Sampler::new(SamplingParams::default());
        assert_eq!(greedy.sample(&logits, &[]), 1);
        // Repetition penalty demotes token 1 below token 3.
        let mut rep = Sampler::new(SamplingParams {
            repetition_penalty: 1.5,
            ..Default::default()
        });
        assert_eq!(rep.sample(&logits, &[1]), 3);
        // top-k 2 only ever yields the two best; min-p 0.5 likewise here; seed reproduces.
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            seed: 7,
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(params.clone());
            (0..200).map(|_| s.sample(&logits, &[])).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(params.clone());
            (0..200).map(|_| s.sample(&logits, &[])).collect()
        };
        assert_eq!(a, b);
        assert!(a.iter().all(|t| *t == 1 || *t == 3) && a.contains(&1) && a.contains(&3));
        let mut minp = Sampler::new(SamplingParams {
            temperature: 1.0,
            min_p: 0.5,
            seed: 1,
            ..Default::default()
        });
        assert!((0..200).all(|_| matches!(minp.sample(&logits, &[]), 1 | 3)));
        let mut topp = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.1,
            seed: 1,
            ..Default::default()
        });
        assert!((0..50).all(|_| topp.sample(&logits, &[]) == 1));
        // Temperature 1 over the full vocabulary follows softmax.
        let mut full = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: 3,
            ..Default::default()
        });
        let two = [0.0f32, (3.0f32).ln()];
        let ones = (0..4000).filter(|_| full.sample(&two, &[]) == 1).count() as f64 / 4000.0;
        assert!((ones - 0.75).abs() < 0.03, "{ones}");
    }
}
