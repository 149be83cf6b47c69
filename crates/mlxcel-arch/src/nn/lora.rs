//! Runtime (unfused) LoRA adapters: an adapted linear layer computes
//! `y = x·Wᵀ + Σᵢ cᵢ·(x·Aᵢᵀ)·Bᵢᵀ` over its unchanged (possibly quantized) base, where the sum runs
//! over the adapters of the model's active [`AdapterMix`] and `cᵢ` is the adapter's own scale
//! times its weight in the mix.
//!
//! Several adapters are registered on one model ([`AdapterSet`], shared by every adapted layer);
//! selecting another mix ([`AdapterSet::select`]) costs no reload: each layer rebuilds its
//! combined low-rank pair the first time it runs under the new mix (the `A`s stacked along the
//! rank, the `B`s scaled by `cᵢ`), so any blend is two thin products per layer. With no adapter
//! active (or every weight 0) an adapted layer runs exactly its base layer: one version check.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::rc::Rc;

use mlxcel_core::{ops, Array};

use crate::{ModelError, Result};

/// Which registered adapters a request runs with: `(name, weight)` pairs, each adding
/// `weight × scale` times its low-rank term (the adapter's own scale: mlx-lm's `scale`, PEFT's
/// `lora_alpha / r`). Empty: the base model. Weight 1 is the adapter as trained; 0 turns it off.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AdapterMix {
    /// `(adapter name, weight)`, in any order; a name may appear once.
    pub entries: Vec<(String, f32)>,
}

impl AdapterMix {
    /// The base model, no adapter.
    pub fn none() -> AdapterMix {
        AdapterMix::default()
    }

    /// One adapter at weight 1 (its trained scale).
    pub fn single(name: impl Into<String>) -> AdapterMix {
        AdapterMix::weighted(name, 1.0)
    }

    /// One adapter with its scale multiplied by `weight`.
    pub fn weighted(name: impl Into<String>, weight: f32) -> AdapterMix {
        AdapterMix {
            entries: vec![(name.into(), weight)],
        }
    }

    /// Several adapters blended: each adds `weight × scale` times its term.
    pub fn blend<S: Into<String>>(entries: impl IntoIterator<Item = (S, f32)>) -> AdapterMix {
        AdapterMix {
            entries: entries.into_iter().map(|(n, w)| (n.into(), w)).collect(),
        }
    }

    /// Whether no adapter contributes (empty, or every weight 0).
    pub fn is_base(&self) -> bool {
        self.entries.iter().all(|(_, w)| *w == 0.0)
    }
}

impl std::fmt::Display for AdapterMix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.entries.is_empty() {
            return f.write_str("base");
        }
        let parts: Vec<String> = self
            .entries
            .iter()
            .map(|(n, w)| {
                if *w == 1.0 {
                    n.clone()
                } else {
                    format!("{n}×{w}")
                }
            })
            .collect();
        f.write_str(&parts.join(" + "))
    }
}

/// The runtime adapters registered on one model and the mix its adapted layers run with.
#[derive(Debug)]
pub struct AdapterSet {
    names: Vec<String>,
    scales: Vec<f64>,
    /// `(adapter index, weight × scale)` of the adapters that contribute.
    active: RefCell<Vec<(usize, f64)>>,
    mix: RefCell<AdapterMix>,
    /// Bumped by every selection; layers rebuild their combined pair when it moved.
    version: Cell<u64>,
}

impl AdapterSet {
    /// Adapters `(name, scale)`, indexed in this order by [`RuntimeAdapters::modules`]; none
    /// active. Names must be distinct.
    pub fn new(adapters: Vec<(String, f64)>) -> Result<Rc<AdapterSet>> {
        let mut names = Vec::with_capacity(adapters.len());
        let mut scales = Vec::with_capacity(adapters.len());
        for (name, scale) in adapters {
            if names.contains(&name) {
                return Err(ModelError::Runtime(format!(
                    "two runtime adapters are named `{name}`"
                )));
            }
            names.push(name);
            scales.push(scale);
        }
        Ok(Rc::new(AdapterSet {
            names,
            scales,
            active: RefCell::new(Vec::new()),
            mix: RefCell::new(AdapterMix::none()),
            version: Cell::new(0),
        }))
    }

    /// The registered adapters' names.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The mix the layers run with now.
    pub fn current(&self) -> AdapterMix {
        self.mix.borrow().clone()
    }

    /// Makes `mix` the one the adapted layers run with (from their next forward pass). An
    /// unknown or repeated name or a non-finite weight is an error and changes nothing.
    pub fn select(&self, mix: &AdapterMix) -> Result<()> {
        if *self.mix.borrow() == *mix {
            return Ok(());
        }
        let mut active = Vec::with_capacity(mix.entries.len());
        for (name, weight) in &mix.entries {
            let Some(index) = self.names.iter().position(|n| n == name) else {
                return Err(ModelError::Runtime(format!(
                    "no runtime adapter named `{name}` (loaded: {})",
                    if self.names.is_empty() {
                        "none".to_string()
                    } else {
                        self.names.join(", ")
                    }
                )));
            };
            if !weight.is_finite() {
                return Err(ModelError::Runtime(format!(
                    "adapter `{name}`: weight {weight} is not finite"
                )));
            }
            if active.iter().any(|(i, _)| *i == index) {
                return Err(ModelError::Runtime(format!(
                    "adapter `{name}` appears twice in the mix"
                )));
            }
            if *weight != 0.0 {
                active.push((index, *weight as f64 * self.scales[index]));
            }
        }
        *self.active.borrow_mut() = active;
        *self.mix.borrow_mut() = mix.clone();
        self.version.set(self.version.get() + 1);
        Ok(())
    }
}

/// One adapter's low-rank pair for one linear layer, in the compute dtype.
#[derive(Debug, Clone)]
pub struct LoraPair {
    /// `A` `[r, in]` (PEFT's `lora_A`; mlx-lm's `lora_a` transposed).
    pub a: Array,
    /// `B` `[out, r]` (PEFT's `lora_B`; mlx-lm's `lora_b` transposed).
    pub b: Array,
    /// Where it came from, for errors (the adapter file and tensor names).
    pub origin: String,
}

/// The runtime adapters a model is built with: the shared set and, per adapted linear layer
/// (by checkpoint module name, e.g. `model.layers.0.self_attn.q_proj`), one optional pair per
/// adapter of the set, in the set's order.
#[derive(Clone)]
pub struct RuntimeAdapters {
    /// The registered adapters and their active mix.
    pub set: Rc<AdapterSet>,
    /// Module name → the pair of each adapter (`None` where that adapter leaves it alone).
    pub modules: BTreeMap<String, Vec<Option<LoraPair>>>,
}

impl std::fmt::Debug for RuntimeAdapters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeAdapters")
            .field("adapters", &self.set.names)
            .field("modules", &self.modules.len())
            .finish()
    }
}

/// The combined low-rank pair of one layer under one mix.
#[derive(Debug)]
struct Combined {
    /// `[Σr, in]`: the active adapters' `A`s stacked.
    a: Array,
    /// `[out, Σr]`: their `B`s side by side, each times its coefficient.
    b: Array,
}

/// The low-rank terms of one adapted linear layer.
#[derive(Debug, Clone)]
pub struct LoraLayer {
    set: Rc<AdapterSet>,
    pairs: Vec<Option<LoraPair>>,
    /// The set's version this was built for, and the pair (`None`: nothing active here).
    combined: RefCell<Option<(u64, Option<Rc<Combined>>)>>,
}

impl LoraLayer {
    /// The terms `pairs` (one per adapter of `set`) of one layer.
    pub fn new(set: Rc<AdapterSet>, pairs: Vec<Option<LoraPair>>) -> LoraLayer {
        LoraLayer {
            set,
            pairs,
            combined: RefCell::new(None),
        }
    }

    /// The arrays it holds.
    pub fn arrays(&self) -> Vec<&Array> {
        self.pairs
            .iter()
            .flatten()
            .flat_map(|p| [&p.a, &p.b])
            .collect()
    }

    /// The combined pair under the set's current mix, `None` when no active adapter touches
    /// this layer.
    fn combined(&self) -> Result<Option<Rc<Combined>>> {
        let version = self.set.version.get();
        if let Some((v, c)) = &*self.combined.borrow() {
            if *v == version {
                return Ok(c.clone());
            }
        }
        let active: Vec<(&LoraPair, f64)> = self
            .set
            .active
            .borrow()
            .iter()
            .filter_map(|&(i, c)| self.pairs[i].as_ref().map(|p| (p, c)))
            .collect();
        let combined = if active.is_empty() {
            None
        } else {
            let scaled = active
                .iter()
                .map(|(p, c)| p.b.mul_scalar(*c))
                .collect::<mlxcel_core::Result<Vec<_>>>()?;
            let (a, b) = if active.len() == 1 {
                (active[0].0.a.clone(), scaled[0].contiguous()?)
            } else {
                let a: Vec<Array> = active.iter().map(|(p, _)| p.a.clone()).collect();
                (ops::concatenate(&a, 0)?, ops::concatenate(&scaled, 1)?)
            };
            // Evaluated once here, not on every forward pass.
            a.eval()?;
            b.eval()?;
            Some(Rc::new(Combined { a, b }))
        };
        *self.combined.borrow_mut() = Some((version, combined.clone()));
        Ok(combined)
    }

    /// Whether an active adapter touches this layer.
    pub fn is_active(&self) -> Result<bool> {
        Ok(self.combined()?.is_some())
    }

    /// `y + Σᵢ cᵢ·(x·Aᵢᵀ)·Bᵢᵀ` (`y` unchanged when nothing is active here).
    pub fn add_to(&self, x: &Array, y: Array) -> Result<Array> {
        match self.combined()? {
            None => Ok(y),
            Some(c) => {
                let low = ops::linear(x, &c.a, None)?;
                Ok(y.add(&ops::linear(&low, &c.b, None)?)?)
            }
        }
    }
}
