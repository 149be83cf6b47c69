//! The model registry. [`for_each_model_registration!`] is the one list of supported model
//! types; `ModelType`, the static descriptors, `model_load_policy()`, `LoadedModel` with its
//! `LanguageModel` delegation and the config-backed loader are all generated from it. Adding a
//! text architecture is one model file and one row here.

use mlxcel_core::{Dtype, Materialization, WeightMap};
use mlxcel_quant::QuantConfig;
use serde_json::Value;

use crate::cache::KvCache;
use crate::model::{Architecture, LanguageModel, LayerKind};
use crate::sanitize::drop_unused_buffers;
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

/// The registry: one row per model type.
///
/// - `names`: the `model_type` strings of `config.json` that map to it;
/// - `kind`: generation, embedding or reranker;
/// - `dir`: how a model folder is loaded (`ConfigBacked`, `Nonstandard`, `Vlm`, `Mistral3Dynamic`);
/// - `weights`: how it is built from preloaded weights, e.g. after fusing a LoRA adapter
///   (`ConfigBacked`, `LlamaFamily`, `Special`, `None`);
/// - `model`: the architecture type;
/// - `adapter`: `None` when adapters are supported, else the message explaining why not.
#[macro_export]
macro_rules! for_each_model_registration {
    ($callback:ident) => {
        $callback! {
            Llama { names: ["llama", "mistral"], kind: Generation, dir: ConfigBacked, weights: LlamaFamily, model: $crate::models::llama::Model, adapter: None },
            Qwen2 { names: ["qwen2"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::qwen2::Model, adapter: None },
            Qwen3 { names: ["qwen3"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::qwen3::Model, adapter: None },
            Gemma { names: ["gemma"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::gemma::Model, adapter: None },
            Gemma2 { names: ["gemma2"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::gemma2::Model, adapter: None },
            Gemma3Text { names: ["gemma3_text"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::gemma3_text::Model, adapter: None },
            Phi3 { names: ["phi3"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::phi3::Model, adapter: None },
            Mixtral { names: ["mixtral"], kind: Generation, dir: ConfigBacked, weights: Special, model: $crate::models::mixtral::Model, adapter: Some("LoRA on mixture-of-experts layers is not supported: adapters would have to target every expert") },
            Qwen2Moe { names: ["qwen2_moe"], kind: Generation, dir: ConfigBacked, weights: Special, model: $crate::models::qwen2_moe::Model, adapter: Some("LoRA on mixture-of-experts layers is not supported: adapters would have to target every expert") },
            Qwen3Moe { names: ["qwen3_moe"], kind: Generation, dir: ConfigBacked, weights: Special, model: $crate::models::qwen3_moe::Model, adapter: Some("LoRA on mixture-of-experts layers is not supported: adapters would have to target every expert") },
            OlMoe { names: ["olmoe"], kind: Generation, dir: ConfigBacked, weights: Special, model: $crate::models::olmoe::Model, adapter: Some("LoRA on mixture-of-experts layers is not supported: adapters would have to target every expert") },
        }
    };
}

/// What a checkpoint is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelKind {
    Generation,
    Embedding,
    Reranker,
}

/// How a model folder is turned into a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirectoryRoute {
    /// `config.json` → `ModelArgs` → build from the safetensors (the generated loader).
    ConfigBacked,
    /// A family-specific directory loader.
    Nonstandard,
    /// Vision encoder + text decoder.
    Vlm,
    /// Inspect the nested `text_config.model_type` first.
    Mistral3Dynamic,
}

/// How a model is built from weights already in memory (LoRA fusing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightRoute {
    ConfigBacked,
    LlamaFamily,
    Special,
    None,
}

/// The routing facts of one model type.
#[derive(Debug, Clone, Copy)]
pub struct StaticModelDescriptor {
    pub model_type: ModelType,
    pub names: &'static [&'static str],
    pub kind: ModelKind,
    pub directory_route: DirectoryRoute,
    pub weight_route: WeightRoute,
    pub architecture: &'static str,
    pub adapter_unsupported: Option<&'static str>,
}

impl StaticModelDescriptor {
    /// The architecture's Rust path, e.g. `mlxcel_models::models::llama::Model`.
    pub fn architecture_path(&self) -> String {
        self.architecture
            .replace(' ', "")
            .replace("$crate", "mlxcel_models")
    }
}

/// The routing decisions for a detected model type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelLoadPolicy {
    pub directory_route: DirectoryRoute,
    pub weight_route: WeightRoute,
}

/// How to build a model: the checkpoint's tensors, quantization and compute dtype.
pub struct BuildOptions {
    pub quant: Option<QuantConfig>,
    pub dtype: Dtype,
    pub materialization: Materialization,
    /// Stream the routed experts of the layers this covers instead of loading them.
    pub stream: Option<crate::weights::ExpertStreamSetup>,
    /// Fuse linear layers that read the same input (q/k/v, gate/up) into one at load, when
    /// they share a storage format. Saves arrays and kernel launches per decode step (what
    /// bounds decode on a GPU) at the cost of one copy of those weights while loading.
    pub fuse_projections: bool,
}

/// Builds one architecture from a sanitised config and its weights: deserialise the args (a
/// missing field is an error naming it), apply the architecture's checkpoint fixes, construct,
/// refuse unused tensors, then materialise per policy.
pub fn build_architecture<M: Architecture>(
    name: &str,
    config: &Value,
    mut weights: WeightMap,
    options: &BuildOptions,
) -> Result<M> {
    let args: M::Args =
        serde_json::from_value(config.clone()).map_err(|e| ModelError::Config(e.to_string()))?;
    if let Some(stream) = &options.stream {
        // Streamed experts stay on disk: drop them before the sanitiser would stack them.
        for layer in &stream.manifest.layers {
            let covered: Vec<String> = weights
                .names()
                .filter(|n| {
                    n.starts_with(&format!("{}.experts.", layer.prefix))
                        || n.starts_with(&format!("{}.switch_mlp.", layer.prefix))
                })
                .map(str::to_string)
                .collect();
            for n in covered {
                weights.remove(&n);
            }
        }
    }
    M::sanitize(&args, &mut weights)?;
    drop_unused_buffers(&mut weights);
    let mut w = ModelWeights::new(weights, options.quant.clone(), options.dtype)
        .with_stream(options.stream.clone())
        .with_fused_projections(options.fuse_projections);
    let model = M::build(&args, &mut w)?;
    let kept = w.finish(name)?;
    options.materialization.apply(kept.iter())?;
    Ok(model)
}

macro_rules! define_registry {
    ($( $variant:ident { names: [$($name:literal),+], kind: $kind:ident, dir: $dir:ident, weights: $weights:ident, model: $model:ty, adapter: $adapter:expr } ),* $(,)?) => {
        /// Every registered model type.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum ModelType { $($variant),* }

        impl ModelType {
            pub const ALL: &'static [ModelType] = &[$(ModelType::$variant),*];

            pub fn name(self) -> &'static str {
                match self { $(ModelType::$variant => stringify!($variant)),* }
            }

            /// The type a `config.json` `model_type` string names, if registered.
            pub fn from_model_type(model_type: &str) -> Option<ModelType> {
                match model_type {
                    $($($name)|+ => Some(ModelType::$variant),)*
                    _ => None,
                }
            }

            pub fn descriptor(self) -> &'static StaticModelDescriptor {
                &DESCRIPTORS[self as usize]
            }
        }

        /// The descriptors, in `ModelType` order.
        pub static DESCRIPTORS: &[StaticModelDescriptor] = &[$(
            StaticModelDescriptor {
                model_type: ModelType::$variant,
                names: &[$($name),+],
                kind: ModelKind::$kind,
                directory_route: DirectoryRoute::$dir,
                weight_route: WeightRoute::$weights,
                architecture: stringify!($model),
                adapter_unsupported: $adapter,
            }
        ),*];

        /// A loaded model of any registered type.
        pub enum LoadedModel { $($variant(Box<$model>)),* }

        impl LoadedModel {
            pub fn model_type(&self) -> ModelType {
                match self { $(LoadedModel::$variant(_) => ModelType::$variant),* }
            }
        }

        impl LanguageModel for LoadedModel {
            fn forward(&self, tokens: &mlxcel_core::Array, caches: &mut [KvCache]) -> Result<mlxcel_core::Array> {
                match self { $(LoadedModel::$variant(m) => m.forward(tokens, caches)),* }
            }
            fn forward_last(&self, tokens: &mlxcel_core::Array, caches: &mut [KvCache]) -> Result<mlxcel_core::Array> {
                match self { $(LoadedModel::$variant(m) => m.forward_last(tokens, caches)),* }
            }
            fn vocab_size(&self) -> usize {
                match self { $(LoadedModel::$variant(m) => m.vocab_size()),* }
            }
            fn layer_schedule(&self) -> Vec<LayerKind> {
                match self { $(LoadedModel::$variant(m) => m.layer_schedule()),* }
            }
            fn make_caches(&self) -> Vec<KvCache> {
                match self { $(LoadedModel::$variant(m) => m.make_caches()),* }
            }
        }

        /// A checkpoint's tensors after its architecture's sanitiser (experts stacked into
        /// `switch_mlp`, ...): what the expert-stream writer slices.
        pub fn sanitized_weights(model_type: ModelType, config: &Value, mut weights: WeightMap) -> Result<WeightMap> {
            match model_type {
                $(ModelType::$variant => {
                    let args: <$model as Architecture>::Args = serde_json::from_value(config.clone())
                        .map_err(|e| ModelError::Config(e.to_string()))?;
                    <$model as Architecture>::sanitize(&args, &mut weights)?;
                }),*
            }
            Ok(weights)
        }

        /// The generated config-backed loader: builds `model_type` from its config and weights.
        pub fn load_config_backed(model_type: ModelType, config: &Value, weights: WeightMap, options: &BuildOptions) -> Result<LoadedModel> {
            let descriptor = model_type.descriptor();
            if descriptor.directory_route != DirectoryRoute::ConfigBacked {
                return Err(ModelError::Unsupported(format!(
                    "{} loads through the {:?} route, not the config-backed loader",
                    model_type.name(), descriptor.directory_route
                )));
            }
            match model_type {
                $(ModelType::$variant => Ok(LoadedModel::$variant(Box::new(
                    build_architecture::<$model>(stringify!($variant), config, weights, options)?
                )))),*
            }
        }
    };
}

for_each_model_registration!(define_registry);

/// The routing decisions for `model_type`, from its registry row.
pub fn model_load_policy(model_type: ModelType) -> ModelLoadPolicy {
    let d = model_type.descriptor();
    ModelLoadPolicy {
        directory_route: d.directory_route,
        weight_route: d.weight_route,
    }
}
