//! Recipes: which tensor of a checkpoint is stored in which format.
//!
//! A recipe looks at one *module* (the mlx-lm module path of a linear, embedding or stacked
//! expert layer, e.g. `model.layers.3.mlp.switch_mlp.down_proj`) together with its [`Role`], its
//! layer index and the model's layer layout, and returns a [`Format`]. Built in:
//!
//! - `uniform` — one format everywhere: `affine{bits}-g{group}` (e.g. `affine4-g64`,
//!   `affine8` = group 64), `mxfp4`, `mxfp8`, `nvfp4`. Like mlx-lm, the model's own predicate
//!   applies on top (qwen3_moe routers, jamba routers, granite's o/down/lm_head at 8 bits).
//! - `mixed_2_6`, `mixed_3_4`, `mixed_3_6`, `mixed_4_6` — mlx-lm 0.32.2's layer choice: the high
//!   width for `lm_head` and, in "use more bits" layers (the first and last eighth and every
//!   third layer between), for `v_proj`/`v_a_proj`/`v_b_proj` and `down_proj`; the low width
//!   elsewhere; group 64, affine.
//! - `moe-role` — per-role precision for large MoEs: routers and norms dense; embedding,
//!   lm_head, attention, shared expert, dense MLP layers and MTP 8-bit; routed gate/up 2-bit,
//!   routed down 3-bit; every routed projection of the first and last sparse layer 4-bit.
//! - user recipes from YAML ([`RuleSet`]): ordered rules matching role / layer range / first or
//!   last sparse layer / name substring; the first rule that matches wins.
//!
//! What can be quantized at all: 2-D weights of linears and embeddings (3-D for stacked experts)
//! whose last dimension is divisible by the group size. Everything else (norms, biases, 1-D
//! tensors, conv kernels, rows not divisible by the group) is kept dense in the source dtype and
//! gets no entry in `config.json`, as mlx-lm does.

use std::collections::BTreeSet;
use std::path::Path;

use serde::Deserialize;
use serde_json::{json, Value};

use crate::{QuantError, QuantMode, QuantSpec, Result};

/// What a tensor does, from its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// The token embedding table (`embed_tokens`, `wte`).
    Embedding,
    /// The output projection to the vocabulary.
    LmHead,
    /// Attention query projection (`q_proj`).
    AttnQ,
    /// Attention key projection (`k_proj`).
    AttnK,
    /// Attention value projection (`v_proj`).
    AttnV,
    /// Attention output projection (`o_proj`, `out_proj`, `dense`).
    AttnO,
    /// Other attention projections (fused qkv, MLA down/up projections).
    AttnOther,
    /// The MLP of a dense (non-MoE) layer.
    DenseMlp,
    /// An MoE router (`mlp.gate`, `router`) or a shared expert's gate.
    Router,
    /// An MoE block's always-active shared expert.
    SharedExpert,
    /// Routed experts' gate projection (`gate_proj`, `w1`).
    ExpertGate,
    /// Routed experts' up projection (`up_proj`, `w3`).
    ExpertUp,
    /// Routed experts' down projection (`down_proj`, `w2`).
    ExpertDown,
    /// A normalisation layer's weight (never quantized).
    Norm,
    /// A multi-token-prediction block (by name, or a layer past `num_hidden_layers`).
    Mtp,
    /// Anything else.
    Other,
}

impl Role {
    /// Every role, in declaration order.
    pub const ALL: [Role; 16] = [
        Role::Embedding,
        Role::LmHead,
        Role::AttnQ,
        Role::AttnK,
        Role::AttnV,
        Role::AttnO,
        Role::AttnOther,
        Role::DenseMlp,
        Role::Router,
        Role::SharedExpert,
        Role::ExpertGate,
        Role::ExpertUp,
        Role::ExpertDown,
        Role::Norm,
        Role::Mtp,
        Role::Other,
    ];

    /// The name used in YAML recipes and reports.
    pub fn name(self) -> &'static str {
        match self {
            Role::Embedding => "embedding",
            Role::LmHead => "lm_head",
            Role::AttnQ => "attn_q",
            Role::AttnK => "attn_k",
            Role::AttnV => "attn_v",
            Role::AttnO => "attn_o",
            Role::AttnOther => "attn_other",
            Role::DenseMlp => "dense_mlp",
            Role::Router => "router",
            Role::SharedExpert => "shared_expert",
            Role::ExpertGate => "expert_gate",
            Role::ExpertUp => "expert_up",
            Role::ExpertDown => "expert_down",
            Role::Norm => "norm",
            Role::Mtp => "mtp",
            Role::Other => "other",
        }
    }

    /// Whether the role is a routed expert projection (gate, up or down).
    pub fn is_routed_expert(self) -> bool {
        matches!(self, Role::ExpertGate | Role::ExpertUp | Role::ExpertDown)
    }

    /// Roles a YAML name selects: a role name, or the groups `attention`, `experts`, `all`.
    pub fn select(name: &str) -> Option<Vec<Role>> {
        Some(match name {
            "attention" => vec![
                Role::AttnQ,
                Role::AttnK,
                Role::AttnV,
                Role::AttnO,
                Role::AttnOther,
            ],
            "experts" | "routed_experts" => {
                vec![Role::ExpertGate, Role::ExpertUp, Role::ExpertDown]
            }
            "all" => Role::ALL.to_vec(),
            _ => vec![*Role::ALL.iter().find(|r| r.name() == name)?],
        })
    }
}

fn last_component(path: &str) -> &str {
    path.rsplit('.').next().unwrap_or(path)
}

/// The role of a tensor or module from its name (`.weight`/`.bias` suffixes are ignored). MTP
/// blocks are recognised by name here (`mtp`); layers past `num_hidden_layers` (DeepSeek-style
/// MTP layers) by [`ModelLayout::role`].
pub fn classify(name: &str) -> Role {
    let module = name
        .strip_suffix(".weight")
        .or_else(|| name.strip_suffix(".bias"))
        .unwrap_or(name);
    let last = last_component(module);
    let has = |s: &str| module.contains(s);
    if has("mtp") {
        Role::Mtp
    } else if has("embed_tokens") || last == "wte" || last == "embeddings" {
        Role::Embedding
    } else if module.starts_with("lm_head") || last == "lm_head" {
        Role::LmHead
    } else if last.contains("norm") || last.starts_with("ln") {
        Role::Norm
    } else if has("shared_expert_gate") {
        Role::Router
    } else if has("shared_expert") {
        Role::SharedExpert
    } else if has(".experts.") || has("switch_mlp") {
        match last {
            "gate_proj" | "w1" => Role::ExpertGate,
            "up_proj" | "w3" => Role::ExpertUp,
            "down_proj" | "w2" => Role::ExpertDown,
            _ => Role::Other,
        }
    } else if last == "router"
        || module.ends_with("mlp.gate")
        || module.ends_with("block_sparse_moe.gate")
    {
        Role::Router
    } else if has("self_attn") || has("attention") || has(".attn.") {
        match last {
            "q_proj" => Role::AttnQ,
            "k_proj" => Role::AttnK,
            "v_proj" => Role::AttnV,
            "o_proj" | "out_proj" | "dense" => Role::AttnO,
            _ => Role::AttnOther,
        }
    } else if has("mlp") || has("feed_forward") {
        Role::DenseMlp
    } else {
        Role::Other
    }
}

/// The layer index of a module: the first all-digit path component.
pub fn layer_index(name: &str) -> Option<usize> {
    name.split('.').find_map(|c| {
        if !c.is_empty() && c.bytes().all(|b| b.is_ascii_digit()) {
            c.parse().ok()
        } else {
            None
        }
    })
}

/// A storage format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// Kept in the source float dtype.
    Dense,
    /// Quantized with this spec.
    Quantized(QuantSpec),
}

impl Format {
    /// Parses `dense`, `affine{bits}[-g{group}]`, `mxfp4`, `mxfp8`, `nvfp4`. A
    /// [`QuantError::Config`] names the format when it is unknown or MLX cannot store it.
    ///
    /// ```
    /// use mlxcel_quant::{Format, QuantMode, QuantSpec};
    ///
    /// let f = Format::parse("affine8")?;
    /// assert_eq!(f, Format::Quantized(QuantSpec::affine(64, 8)));
    /// assert_eq!(f.name(), "affine8-g64");
    /// assert_eq!(
    ///     Format::parse("mxfp4")?,
    ///     Format::Quantized(QuantSpec::fixed(QuantMode::Mxfp4).unwrap())
    /// );
    /// assert!(Format::parse("affine7-g64").is_err());
    /// # Ok::<(), mlxcel_quant::QuantError>(())
    /// ```
    pub fn parse(name: &str) -> Result<Format> {
        let bad = |message: String| QuantError::Config {
            field: "recipe format".into(),
            message,
        };
        let name = name.trim();
        if name == "dense" {
            return Ok(Format::Dense);
        }
        if let Some(mode) = QuantMode::from_name(name) {
            return match QuantSpec::fixed(mode) {
                Some(spec) => Ok(Format::Quantized(spec)),
                None => Ok(Format::Quantized(QuantSpec::affine(64, 4))),
            };
        }
        let Some(rest) = name.strip_prefix("affine") else {
            return Err(bad(format!(
                "unknown format `{name}` (dense, affine{{bits}}-g{{group}}, mxfp4, mxfp8, nvfp4)"
            )));
        };
        let (bits, group) = match rest.split_once("-g") {
            Some((b, g)) => (b, g),
            None => (rest, "64"),
        };
        let bits: i32 = bits
            .parse()
            .map_err(|_| bad(format!("`{name}`: bits `{bits}` is not a number")))?;
        let group: i32 = group
            .parse()
            .map_err(|_| bad(format!("`{name}`: group `{group}` is not a number")))?;
        let spec = QuantSpec::affine(group, bits);
        check_spec(spec).map_err(bad)?;
        Ok(Format::Quantized(spec))
    }

    /// The name [`Format::parse`] reads back: `dense`, `affine{bits}-g{group}`, `mxfp4`, ...
    pub fn name(&self) -> String {
        match self {
            Format::Dense => "dense".into(),
            Format::Quantized(s) if s.mode == QuantMode::Affine => {
                format!("affine{}-g{}", s.bits, s.group_size)
            }
            Format::Quantized(s) => s.mode.name().into(),
        }
    }
}

/// Whether MLX can store `spec`: affine 1–6 or 8 bits in groups of 32, 64 or 128; the fp modes
/// with their fixed layout.
pub fn check_spec(spec: QuantSpec) -> std::result::Result<(), String> {
    match spec.mode.fixed_layout() {
        Some((g, b)) if (g, b) != (spec.group_size, spec.bits) => Err(format!(
            "{} has groups of {g} and {b} bits, not {} / {}",
            spec.mode, spec.group_size, spec.bits
        )),
        Some(_) => Ok(()),
        None if !matches!(spec.bits, 1..=6 | 8) => Err(format!(
            "unsupported affine bit width {} (1-6 or 8)",
            spec.bits
        )),
        None if !matches!(spec.group_size, 32 | 64 | 128) => Err(format!(
            "unsupported affine group size {} (32, 64, 128)",
            spec.group_size
        )),
        None => Ok(()),
    }
}

/// What the recipe needs to know about the model beyond a module's name.
#[derive(Debug, Clone, Default)]
pub struct ModelLayout {
    /// `config.json` `model_type`.
    pub model_type: String,
    /// `num_hidden_layers` (layers at or past it are MTP layers).
    pub num_layers: usize,
    /// Layers holding routed experts.
    pub sparse_layers: BTreeSet<usize>,
    /// mlx-lm's `layer_location`: the path position of the layer index in the first module whose
    /// path contains `down_proj` (`None` when no module has one).
    pub layer_location: Option<usize>,
}

impl ModelLayout {
    /// Builds the layout from the config and the module paths that will be written.
    pub fn new<'a>(config: &Value, modules: impl IntoIterator<Item = &'a str>) -> ModelLayout {
        let text = config.get("text_config").unwrap_or(config);
        let get = |k: &str| {
            text.get(k)
                .or_else(|| config.get(k))
                .and_then(Value::as_u64)
        };
        let model_type = text
            .get("model_type")
            .or_else(|| config.get("model_type"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let num_layers = get("num_hidden_layers")
            .or_else(|| get("n_layer"))
            .unwrap_or(0) as usize;
        let mut sparse_layers = BTreeSet::new();
        let mut down: Vec<&str> = Vec::new();
        for m in modules {
            if classify(m).is_routed_expert() {
                if let Some(i) = layer_index(m) {
                    sparse_layers.insert(i);
                }
            }
            if m.contains("down_proj") {
                down.push(m);
            }
        }
        down.sort_unstable();
        let layer_location = down.first().and_then(|k| {
            k.split('.')
                .position(|c| !c.is_empty() && c.bytes().all(|b| b.is_ascii_digit()))
        });
        ModelLayout {
            model_type,
            num_layers,
            sparse_layers,
            layer_location,
        }
    }

    /// The role of `module`, counting layers past `num_hidden_layers` as MTP.
    pub fn role(&self, module: &str) -> Role {
        let role = classify(module);
        match (role, layer_index(module)) {
            (Role::Norm, _) => Role::Norm,
            (_, Some(i)) if self.num_layers > 0 && i >= self.num_layers => Role::Mtp,
            _ => role,
        }
    }
}

/// A recipe's decision for one module: the format and the `config.json` entry mlx-lm would
/// write for it (`None`: no per-module entry, the defaults apply).
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The format the module is stored in.
    pub format: Format,
    /// The module's entry in `config.json`'s `quantization` block (`{group_size, bits, mode}`);
    /// `None` when the module is dense or the checkpoint-wide defaults describe it.
    pub config_entry: Option<Value>,
    /// The recipe chose a quantized format the module's rows cannot hold (not a whole number
    /// of groups), so it stays dense.
    pub kept_dense: bool,
}

/// Which sparse layer a rule targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SparseEdge {
    /// The first layer holding routed experts.
    First,
    /// The last layer holding routed experts.
    Last,
    /// The first or the last.
    Edge,
}

/// One rule of a [`RuleSet`].
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// Empty: every role.
    pub roles: Vec<Role>,
    /// Inclusive layer range.
    pub layers: Option<(usize, usize)>,
    /// Only modules of the first/last sparse layer.
    pub sparse: Option<SparseEdge>,
    /// Only modules whose path contains this substring.
    pub name_contains: Option<String>,
    /// The format of the modules the rule matches.
    pub format: Format,
}

/// An ordered list of rules with a default format.
#[derive(Debug, Clone, PartialEq)]
pub struct RuleSet {
    /// The recipe's name (reports, `config.json`).
    pub name: String,
    /// The format of modules no rule matches.
    pub default: Format,
    /// The rules, in order: the first that matches wins.
    pub rules: Vec<Rule>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRule {
    #[serde(default)]
    roles: Vec<String>,
    #[serde(default)]
    layers: Option<String>,
    #[serde(default)]
    sparse: Option<SparseEdge>,
    #[serde(default)]
    name_contains: Option<String>,
    format: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRecipe {
    #[serde(default)]
    name: Option<String>,
    default: String,
    #[serde(default)]
    rules: Vec<YamlRule>,
}

fn parse_layers(s: &str, field: &str) -> Result<(usize, usize)> {
    let bad = || QuantError::Config {
        field: field.into(),
        message: format!("`{s}` is not a layer index or an inclusive range like `0-3`"),
    };
    let (a, b) = match s.split_once('-') {
        Some((a, b)) => (a.trim(), b.trim()),
        None => (s.trim(), s.trim()),
    };
    let a: usize = a.parse().map_err(|_| bad())?;
    let b: usize = b.parse().map_err(|_| bad())?;
    if a > b {
        return Err(bad());
    }
    Ok((a, b))
}

impl RuleSet {
    /// Parses a YAML recipe:
    ///
    /// ```yaml
    /// name: my-recipe
    /// default: affine4-g64
    /// rules:
    ///   - roles: [router, norm]
    ///     format: dense
    ///   - roles: [experts]
    ///     sparse: edge          # first | last | edge
    ///     format: affine4-g64
    ///   - roles: [expert_gate, expert_up]
    ///     layers: "4-40"        # inclusive
    ///     format: affine2-g64
    ///   - name_contains: "layers.0."
    ///     format: affine8-g64
    /// ```
    pub fn from_yaml(text: &str) -> Result<RuleSet> {
        let y: YamlRecipe = serde_yaml::from_str(text).map_err(|e| QuantError::Config {
            field: "recipe".into(),
            message: format!("invalid YAML recipe: {e}"),
        })?;
        let with_field = |field: String, e: QuantError| match e {
            QuantError::Config { message, .. } => QuantError::Config { field, message },
            other => other,
        };
        let default = Format::parse(&y.default).map_err(|e| with_field("default".into(), e))?;
        let mut rules = Vec::new();
        for (i, r) in y.rules.into_iter().enumerate() {
            let field = |k: &str| format!("rules[{i}].{k}");
            let mut roles = Vec::new();
            for name in &r.roles {
                roles.extend(Role::select(name).ok_or_else(|| QuantError::Config {
                    field: field("roles"),
                    message: format!(
                        "unknown role `{name}` (one of {}, attention, experts, all)",
                        Role::ALL.map(Role::name).join(", ")
                    ),
                })?);
            }
            let layers = r
                .layers
                .as_deref()
                .map(|s| parse_layers(s, &field("layers")))
                .transpose()?;
            let format = Format::parse(&r.format).map_err(|e| with_field(field("format"), e))?;
            rules.push(Rule {
                roles,
                layers,
                sparse: r.sparse,
                name_contains: r.name_contains,
                format,
            });
        }
        Ok(RuleSet {
            name: y.name.unwrap_or_else(|| "custom".into()),
            default,
            rules,
        })
    }

    fn decide(&self, module: &str, role: Role, layout: &ModelLayout) -> Format {
        let layer = layer_index(module);
        for r in &self.rules {
            if !r.roles.is_empty() && !r.roles.contains(&role) {
                continue;
            }
            if let Some((a, b)) = r.layers {
                if !layer.is_some_and(|l| (a..=b).contains(&l)) {
                    continue;
                }
            }
            if let Some(edge) = r.sparse {
                let first = layout.sparse_layers.first().copied();
                let last = layout.sparse_layers.last().copied();
                let hit = match edge {
                    SparseEdge::First => layer.is_some() && layer == first,
                    SparseEdge::Last => layer.is_some() && layer == last,
                    SparseEdge::Edge => layer.is_some() && (layer == first || layer == last),
                };
                if !hit {
                    continue;
                }
            }
            if let Some(s) = &r.name_contains {
                if !module.contains(s.as_str()) {
                    continue;
                }
            }
            return r.format;
        }
        self.default
    }

    /// The built-in role recipe for large MoEs (seed 003).
    pub fn moe_role() -> RuleSet {
        let f = |s: &str| Format::parse(s).unwrap_or(Format::Dense);
        let rule = |roles: &[Role], sparse: Option<SparseEdge>, format: Format| Rule {
            roles: roles.to_vec(),
            layers: None,
            sparse,
            name_contains: None,
            format,
        };
        let experts = [Role::ExpertGate, Role::ExpertUp, Role::ExpertDown];
        RuleSet {
            name: "moe-role".into(),
            default: f("affine8-g64"),
            rules: vec![
                rule(&[Role::Router, Role::Norm], None, Format::Dense),
                rule(&experts, Some(SparseEdge::Edge), f("affine4-g64")),
                rule(&[Role::ExpertGate, Role::ExpertUp], None, f("affine2-g64")),
                rule(&[Role::ExpertDown], None, f("affine3-g64")),
                rule(
                    &[
                        Role::Embedding,
                        Role::LmHead,
                        Role::AttnQ,
                        Role::AttnK,
                        Role::AttnV,
                        Role::AttnO,
                        Role::AttnOther,
                        Role::SharedExpert,
                        Role::DenseMlp,
                        Role::Mtp,
                    ],
                    None,
                    f("affine8-g64"),
                ),
            ],
        }
    }
}

/// A recipe.
#[derive(Debug, Clone, PartialEq)]
pub enum Recipe {
    /// One format everywhere (plus the model's own predicate, as mlx-lm applies it).
    Uniform(QuantSpec),
    /// mlx-lm's `mixed_{low}_{high}` recipes.
    Mixed {
        /// Bit width of most modules.
        low: i32,
        /// Bit width of `lm_head` and the "use more bits" layers' `v_proj`/`down_proj`.
        high: i32,
        /// Group size (64).
        group: i32,
    },
    /// Ordered rules (`moe-role` or a YAML recipe).
    Rules(RuleSet),
}

/// The built-in recipe names (besides `uniform` formats such as `affine4-g64` or `mxfp4`).
pub const BUILTIN_RECIPES: [&str; 5] = [
    "mixed_2_6",
    "mixed_3_4",
    "mixed_3_6",
    "mixed_4_6",
    "moe-role",
];

impl Recipe {
    /// A built-in recipe by name (`mixed_3_6`, `moe-role`, a uniform format like `affine4-g64`,
    /// `uniform:mxfp4`), or a YAML file when `name` is a path to one.
    pub fn resolve(name: &str) -> Result<Recipe> {
        let path = Path::new(name);
        if name.ends_with(".yaml") || name.ends_with(".yml") || path.is_file() {
            let text = std::fs::read_to_string(path).map_err(|e| QuantError::Config {
                field: "recipe".into(),
                message: format!("{}: {e}", path.display()),
            })?;
            return Ok(Recipe::Rules(RuleSet::from_yaml(&text)?));
        }
        let mixed = |low, high| Recipe::Mixed {
            low,
            high,
            group: 64,
        };
        Ok(match name {
            "mixed_2_6" => mixed(2, 6),
            "mixed_3_4" => mixed(3, 4),
            "mixed_3_6" => mixed(3, 6),
            "mixed_4_6" => mixed(4, 6),
            "moe-role" => Recipe::Rules(RuleSet::moe_role()),
            other => {
                let fmt = other.strip_prefix("uniform:").unwrap_or(other);
                match Format::parse(fmt) {
                    Ok(Format::Quantized(spec)) => Recipe::Uniform(spec),
                    _ => {
                        return Err(QuantError::Config {
                            field: "recipe".into(),
                            message: format!(
                                "unknown recipe `{name}`: a built-in ({}), a uniform format (affine4-g64, affine8-g32, mxfp4, mxfp8, nvfp4) or a .yaml file",
                                BUILTIN_RECIPES.join(", ")
                            ),
                        })
                    }
                }
            }
        })
    }

    /// A short name for reports.
    pub fn name(&self) -> String {
        match self {
            Recipe::Uniform(s) => Format::Quantized(*s).name(),
            Recipe::Mixed { low, high, .. } => format!("mixed_{low}_{high}"),
            Recipe::Rules(r) => r.name.clone(),
        }
    }

    /// The checkpoint-wide defaults written as `quantization.{group_size, bits, mode}`.
    pub fn defaults(&self) -> QuantSpec {
        match self {
            Recipe::Uniform(s) => *s,
            // mlx-lm writes the command line's defaults (4 bits) for its mixed recipes.
            Recipe::Mixed { group, .. } => QuantSpec::affine(*group, 4),
            Recipe::Rules(r) => match r.default {
                Format::Quantized(s) => s,
                Format::Dense => QuantSpec::affine(64, 4),
            },
        }
    }

    /// Decides the format of the quantizable module `module` (a linear, embedding or expert
    /// stack) whose weight's last dimension is `in_features`. Modules the format cannot hold
    /// (`in_features` not a multiple of the group) are dense.
    pub fn decide(&self, module: &str, in_features: i32, layout: &ModelLayout) -> Decision {
        let role = layout.role(module);
        let dense = Decision {
            format: Format::Dense,
            config_entry: None,
            kept_dense: true,
        };
        let divides = |spec: QuantSpec| spec.group_size > 0 && in_features % spec.group_size == 0;
        match self {
            Recipe::Uniform(spec) => {
                if !divides(*spec) {
                    return dense;
                }
                match native_override(&layout.model_type, module) {
                    Some(over) => {
                        let entry = if spec.mode == QuantMode::Affine {
                            json!({"group_size": over.group_size, "bits": over.bits})
                        } else {
                            json!({"group_size": over.group_size, "bits": over.bits, "mode": "affine"})
                        };
                        if !divides(over) {
                            return dense;
                        }
                        Decision {
                            format: Format::Quantized(over),
                            config_entry: Some(entry),
                            kept_dense: false,
                        }
                    }
                    None => Decision {
                        format: Format::Quantized(*spec),
                        config_entry: None,
                        kept_dense: false,
                    },
                }
            }
            Recipe::Mixed { low, high, group } => {
                if in_features % group != 0 {
                    return dense;
                }
                let bits = mixed_bits(module, *low, *high, layout);
                let spec = QuantSpec::affine(*group, bits);
                Decision {
                    format: Format::Quantized(spec),
                    config_entry: Some(config_entry(spec)),
                    kept_dense: false,
                }
            }
            Recipe::Rules(rules) => match rules.decide(module, role, layout) {
                Format::Quantized(spec) if divides(spec) => Decision {
                    format: Format::Quantized(spec),
                    config_entry: Some(config_entry(spec)),
                    kept_dense: false,
                },
                Format::Quantized(_) => dense,
                Format::Dense => Decision {
                    kept_dense: false,
                    ..dense
                },
            },
        }
    }
}

/// The per-module `config.json` entry mlx-lm writes.
pub fn config_entry(spec: QuantSpec) -> Value {
    json!({"group_size": spec.group_size, "bits": spec.bits, "mode": spec.mode.name()})
}

/// The model classes' own `quant_predicate` in mlx-lm 0.32.2 (applied by uniform conversions).
fn native_override(model_type: &str, module: &str) -> Option<QuantSpec> {
    let eight = Some(QuantSpec::affine(64, 8));
    match model_type {
        "qwen3_moe" if module.ends_with("mlp.gate") => eight,
        "jamba" if module.ends_with("router") => eight,
        "granite"
            if module.ends_with("self_attn.o_proj")
                || module.ends_with("mlp.down_proj")
                || module == "lm_head" =>
        {
            eight
        }
        _ => None,
    }
}

/// mlx-lm's `mixed_quant_predicate`: the layer index is read at `layer_location` (0 when the
/// path is shorter), and "use more bits" layers are the first and last eighth plus every third.
fn mixed_bits(module: &str, low: i32, high: i32, layout: &ModelLayout) -> i32 {
    let parts: Vec<&str> = module.split('.').collect();
    let index: i64 = match layout.layer_location {
        Some(loc) if parts.len() > loc => parts[loc].parse().unwrap_or(0),
        _ => 0,
    };
    let n = layout.num_layers as i64;
    let use_more_bits = index < n / 8 || index >= 7 * n / 8 || (index - n / 8).rem_euclid(3) == 2;
    let has = |s: &str| module.contains(s);
    if (has("v_proj") || has("v_a_proj") || has("v_b_proj")) && use_more_bits {
        return high;
    }
    if has("down_proj") && use_more_bits {
        return high;
    }
    if has("lm_head") {
        return high;
    }
    low
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(n: usize, modules: &[&str]) -> ModelLayout {
        ModelLayout::new(
            &json!({"num_hidden_layers": n, "model_type": "llama"}),
            modules.iter().copied(),
        )
    }

    #[test]
    fn roles_from_names() {
        let cases = [
            ("model.embed_tokens.weight", Role::Embedding),
            ("lm_head.weight", Role::LmHead),
            ("model.layers.0.self_attn.q_proj.weight", Role::AttnQ),
            ("model.layers.0.self_attn.v_proj", Role::AttnV),
            ("model.layers.0.self_attn.o_proj", Role::AttnO),
            ("model.layers.0.self_attn.k_norm.weight", Role::Norm),
            ("model.layers.0.input_layernorm.weight", Role::Norm),
            ("model.layers.0.mlp.gate", Role::Router),
            ("model.layers.0.block_sparse_moe.gate", Role::Router),
            ("model.layers.0.mlp.shared_expert_gate", Role::Router),
            (
                "model.layers.0.mlp.shared_expert.up_proj",
                Role::SharedExpert,
            ),
            (
                "model.layers.0.mlp.experts.3.gate_proj.weight",
                Role::ExpertGate,
            ),
            (
                "model.layers.0.block_sparse_moe.experts.1.w2.weight",
                Role::ExpertDown,
            ),
            ("model.layers.0.mlp.switch_mlp.up_proj", Role::ExpertUp),
            ("model.layers.0.mlp.down_proj", Role::DenseMlp),
            ("model.mtp.0.proj", Role::Mtp),
        ];
        for (name, role) in cases {
            assert_eq!(classify(name), role, "{name}");
        }
        let l = layout(2, &[]);
        assert_eq!(l.role("model.layers.2.self_attn.q_proj"), Role::Mtp);
        assert_eq!(l.role("model.layers.1.self_attn.q_proj"), Role::AttnQ);
    }

    #[test]
    fn formats_parse_and_refuse() {
        assert_eq!(
            Format::parse("affine4-g64").unwrap(),
            Format::Quantized(QuantSpec::affine(64, 4))
        );
        assert_eq!(
            Format::parse("affine8").unwrap(),
            Format::Quantized(QuantSpec::affine(64, 8))
        );
        assert_eq!(Format::parse("dense").unwrap(), Format::Dense);
        assert_eq!(Format::parse("nvfp4").unwrap().name(), "nvfp4".to_string());
        let e = Format::parse("affine7-g64").unwrap_err().to_string();
        assert!(e.contains("bit width 7"), "{e}");
        let e = Format::parse("affine4-g48").unwrap_err().to_string();
        assert!(e.contains("group size 48"), "{e}");
        let e = Format::parse("int4").unwrap_err().to_string();
        assert!(e.contains("unknown format `int4`"), "{e}");
    }

    #[test]
    fn mixed_matches_mlx_lm_rule() {
        // 16 layers: n/8 = 2, 7n/8 = 14: more bits at 0,1,14,15 and 4,7,10,13.
        let l = layout(16, &["model.layers.0.mlp.down_proj"]);
        let more: Vec<usize> = (0..16)
            .filter(|i| mixed_bits(&format!("model.layers.{i}.mlp.down_proj"), 3, 6, &l) == 6)
            .collect();
        assert_eq!(more, vec![0, 1, 4, 7, 10, 13, 14, 15]);
        assert_eq!(mixed_bits("model.layers.4.self_attn.q_proj", 3, 6, &l), 3);
        assert_eq!(mixed_bits("model.layers.4.self_attn.v_proj", 3, 6, &l), 6);
        assert_eq!(mixed_bits("lm_head", 3, 6, &l), 6);
        // The embedding reads index 0, which is a "more bits" layer, but it is neither v nor down.
        assert_eq!(mixed_bits("model.embed_tokens", 2, 6, &l), 2);
        let r = Recipe::resolve("mixed_3_6").unwrap();
        assert_eq!(
            r.decide("model.layers.0.mlp.down_proj", 100, &l).format,
            Format::Dense
        );
    }

    #[test]
    fn moe_role_and_yaml() {
        let modules = [
            "model.layers.0.mlp.down_proj",
            "model.layers.1.mlp.switch_mlp.down_proj",
            "model.layers.2.mlp.switch_mlp.down_proj",
            "model.layers.3.mlp.switch_mlp.down_proj",
        ];
        let l = layout(4, &modules);
        assert_eq!(
            l.sparse_layers.iter().copied().collect::<Vec<_>>(),
            [1, 2, 3]
        );
        let r = Recipe::resolve("moe-role").unwrap();
        let bits = |m: &str| match r.decide(m, 64, &l).format {
            Format::Quantized(s) => s.bits,
            Format::Dense => 0,
        };
        assert_eq!(bits("model.layers.1.mlp.switch_mlp.gate_proj"), 4);
        assert_eq!(bits("model.layers.3.mlp.switch_mlp.down_proj"), 4);
        assert_eq!(bits("model.layers.2.mlp.switch_mlp.gate_proj"), 2);
        assert_eq!(bits("model.layers.2.mlp.switch_mlp.up_proj"), 2);
        assert_eq!(bits("model.layers.2.mlp.switch_mlp.down_proj"), 3);
        assert_eq!(bits("model.layers.2.mlp.gate"), 0);
        assert_eq!(bits("model.layers.0.mlp.down_proj"), 8);
        assert_eq!(bits("model.layers.2.self_attn.q_proj"), 8);
        assert_eq!(bits("model.embed_tokens"), 8);
        assert_eq!(bits("model.layers.4.self_attn.q_proj"), 8); // MTP layer
        let y = RuleSet::from_yaml(
            "name: t\ndefault: affine4-g64\nrules:\n  - roles: [attention]\n    layers: \"1-2\"\n    format: affine6-g32\n  - name_contains: lm_head\n    format: dense\n",
        )
        .unwrap();
        let r = Recipe::Rules(y);
        assert_eq!(
            r.decide("model.layers.1.self_attn.k_proj", 64, &l).format,
            Format::Quantized(QuantSpec::affine(32, 6))
        );
        assert_eq!(
            r.decide("model.layers.0.self_attn.k_proj", 64, &l).format,
            Format::Quantized(QuantSpec::affine(64, 4))
        );
        assert_eq!(r.decide("lm_head", 64, &l).format, Format::Dense);
        let e = RuleSet::from_yaml(
            "default: affine4\nrules:\n  - roles: [routers]\n    format: dense\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("rules[0].roles") && e.contains("`routers`"),
            "{e}"
        );
        let e = RuleSet::from_yaml("default: affine4\nrules:\n  - format: affine9\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rules[0].format") && e.contains("bit width 9"),
            "{e}"
        );
    }
}
