//! The model registry. [`for_each_model_registration!`](crate::for_each_model_registration) is
//! the one list of supported model types; `ModelType`, the static descriptors,
//! `model_load_policy()`, `LoadedModel` with its `LanguageModel` delegation and the
//! config-backed loader are all generated from it. Adding a text architecture is one model file
//! and one row here.

use mlxcel_core::{Dtype, Materialization, WeightMap};
use mlxcel_quant::QuantConfig;
use serde_json::Value;

use crate::cache::LayerCache;
use crate::embedding::EmbeddingModel;
use crate::model::{Architecture, LanguageModel, LayerKind};
use crate::rerank::RerankerModel;
use crate::sanitize::drop_unused_buffers;
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

/// The registry: one row per model type.
///
/// - `names`: the `model_type` strings of `config.json` that map to it; for a `Reranker` row the
///   `architectures` entry instead (a cross-encoder shares its backbone's `model_type`, and
///   [`crate::detection::get_reranker_type`] selects it by architecture);
/// - `kind`: generation, embedding or reranker (each kind gets its own loaded-model enum);
/// - `dir`: how a model folder is loaded (`ConfigBacked`, `Nonstandard`, `Vlm`, `Mistral3Dynamic`);
/// - `weights`: how it is built from weights already in memory (`ConfigBacked`: from a
///   `WeightMap` through the generated loader, which is what fused adapters and surgery need);
/// - `model`: the architecture type;
/// - `adapter`: `None` when the type itself does not rule adapters out, else why it does (see
///   [`adapter_support`]: fused LoRA adapters on dense checkpoints).
#[macro_export]
macro_rules! for_each_model_registration {
    ($callback:ident) => {
        $callback! {
            Llama { names: ["llama", "mistral"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::llama::Model, adapter: None },
            Qwen2 { names: ["qwen2"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::qwen2::Model, adapter: None },
            Qwen3 { names: ["qwen3"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::qwen3::Model, adapter: None },
            Gemma { names: ["gemma"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::gemma::Model, adapter: None },
            Gemma2 { names: ["gemma2"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::gemma2::Model, adapter: None },
            Gemma3Text { names: ["gemma3_text"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::gemma3_text::Model, adapter: None },
            Phi3 { names: ["phi3"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::phi3::Model, adapter: None },
            Cohere { names: ["cohere"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::cohere::Model, adapter: None },
            Granite { names: ["granite"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::granite::Model, adapter: None },
            Glm4 { names: ["glm4"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::glm4::Model, adapter: None },
            Exaone4 { names: ["exaone4"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::exaone4::Model, adapter: None },
            Starcoder2 { names: ["starcoder2"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::starcoder2::Model, adapter: None },
            Olmo2 { names: ["olmo2"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::olmo2::Model, adapter: None },
            Olmo3 { names: ["olmo3"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::olmo3::Model, adapter: None },
            SmolLM3 { names: ["smollm3"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::smollm3::Model, adapter: None },
            Phi { names: ["phi"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::phi::Model, adapter: None },
            StableLm { names: ["stablelm"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::stablelm::Model, adapter: None },
            GptNeoX { names: ["gpt_neox"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::gpt_neox::Model, adapter: None },
            Cohere2 { names: ["cohere2"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::cohere2::Model, adapter: None },
            SeedOss { names: ["seed_oss"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::seed_oss::Model, adapter: None },
            Ernie4_5 { names: ["ernie4_5"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::ernie4_5::Model, adapter: None },
            Exaone { names: ["exaone"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::exaone::Model, adapter: None },
            Apertus { names: ["apertus"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::apertus::Model, adapter: None },
            GptJ { names: ["gptj"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::gptj::Model, adapter: None },
            HunyuanDense { names: ["hunyuan_v1_dense"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::hunyuan::DenseModel, adapter: None },
            Mixtral { names: ["mixtral"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::mixtral::Model, adapter: None },
            Qwen2Moe { names: ["qwen2_moe"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::qwen2_moe::Model, adapter: None },
            Qwen3Moe { names: ["qwen3_moe"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::qwen3_moe::Model, adapter: None },
            OlMoe { names: ["olmoe"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::olmoe::Model, adapter: None },
            DeepseekV2 { names: ["deepseek_v2"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::deepseek::V2Model, adapter: None },
            DeepseekV3 { names: ["deepseek_v3"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::deepseek::V3Model, adapter: None },
            HunyuanMoe { names: ["hunyuan_v1_moe"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::hunyuan::MoeModel, adapter: None },
            Glm4Moe { names: ["glm4_moe"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::glm4_moe::Model, adapter: None },
            Dots1 { names: ["dots1"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::dots1::Model, adapter: None },
            Ernie45Moe { names: ["ernie4_5_moe"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::ernie4_5_moe::Model, adapter: None },
            GptOss { names: ["gpt_oss"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::gpt_oss::Model, adapter: None },
            Ministral3 { names: ["ministral3"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::ministral3::Model, adapter: None },
            Llama4Text { names: ["llama4_text"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::llama4::Model, adapter: None },
            Llama4 { names: ["llama4"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::llama4::NestedModel, adapter: None },
            ExaoneMoe { names: ["exaone_moe"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::exaone_moe::Model, adapter: None },
            MiniMax { names: ["minimax"], kind: Generation, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::minimax::Model, adapter: None },
            Mistral3 { names: ["mistral3"], kind: Generation, dir: Mistral3Dynamic, weights: None, model: $crate::models::mistral3::Model, adapter: None },
            Mamba { names: ["mamba", "falcon_mamba"], kind: Generation, dir: Nonstandard, weights: None, model: $crate::models::mamba::Model, adapter: None },
            Mamba2 { names: ["mamba2"], kind: Generation, dir: Nonstandard, weights: None, model: $crate::models::mamba2::Model, adapter: None },
            Jamba { names: ["jamba"], kind: Generation, dir: Nonstandard, weights: None, model: $crate::models::jamba::Model, adapter: None },
            Bamba { names: ["bamba"], kind: Generation, dir: Nonstandard, weights: None, model: $crate::models::bamba::Model, adapter: None },
            Qwen3Next { names: ["qwen3_next"], kind: Generation, dir: Nonstandard, weights: None, model: $crate::models::qwen3_next::Model, adapter: None },
            Qwen3_5 { names: ["qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"], kind: Generation, dir: Nonstandard, weights: None, model: $crate::models::qwen3_5::Model, adapter: None },
            Rwkv7 { names: ["rwkv7"], kind: Generation, dir: Nonstandard, weights: None, model: $crate::models::rwkv7::Model, adapter: None },
            Gemma3n { names: ["gemma3n", "gemma3n_text"], kind: Generation, dir: Nonstandard, weights: None, model: $crate::models::gemma3n::Model, adapter: None },
            Gemma3 { names: ["gemma3"], kind: Generation, dir: Vlm, weights: None, model: $crate::models::gemma3::Model, adapter: Some("vision-language models take no adapters") },
            QwenVl { names: ["qwen2_vl", "qwen2_5_vl"], kind: Generation, dir: Vlm, weights: None, model: $crate::vision::qwen2_vl::Model, adapter: Some("vision-language models take no adapters") },
            Llava { names: ["llava"], kind: Generation, dir: Vlm, weights: None, model: $crate::models::llava::Model, adapter: Some("vision-language models take no adapters") },
            Idefics3 { names: ["idefics3", "smolvlm"], kind: Generation, dir: Vlm, weights: None, model: $crate::models::idefics3::Model, adapter: Some("vision-language models take no adapters") },
            NemotronH { names: ["nemotron_h"], kind: Generation, dir: Nonstandard, weights: None, model: $crate::models::nemotron_h::Model, adapter: None },
            RecurrentGemma { names: ["recurrent_gemma"], kind: Generation, dir: Nonstandard, weights: None, model: $crate::models::recurrent_gemma::Model, adapter: None },
            FalconH1 { names: ["falcon_h1"], kind: Generation, dir: Nonstandard, weights: None, model: $crate::models::falcon_h1::Model, adapter: None },
            Bert { names: ["bert"], kind: Embedding, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::bert::Model, adapter: Some("encoders take no adapters") },
            XlmRoberta { names: ["xlm-roberta"], kind: Embedding, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::bert::Model, adapter: Some("encoders take no adapters") },
            ModernBert { names: ["modernbert"], kind: Embedding, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::modernbert::Model, adapter: Some("encoders take no adapters") },
            BertReranker { names: ["BertForSequenceClassification"], kind: Reranker, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::bert::Classifier, adapter: Some("cross-encoders take no adapters") },
            XlmRobertaReranker { names: ["XLMRobertaForSequenceClassification"], kind: Reranker, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::bert::Classifier, adapter: Some("cross-encoders take no adapters") },
            ModernBertReranker { names: ["ModernBertForSequenceClassification"], kind: Reranker, dir: ConfigBacked, weights: ConfigBacked, model: $crate::models::modernbert::Classifier, adapter: Some("cross-encoders take no adapters") },
        }
    };
}

/// What a checkpoint is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelKind {
    /// A decoder: token ids in, next-token logits out ([`GenerationModel`]).
    Generation,
    /// An encoder producing one vector per input ([`EmbeddingModelEnum`]).
    Embedding,
    /// A cross-encoder scoring query/document pairs ([`RerankerModelEnum`]).
    Reranker,
}

/// How a model folder is turned into a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirectoryRoute {
    /// `config.json` → `ModelArgs` → build from the safetensors (the generated loader).
    ConfigBacked,
    /// A family-specific directory loader, named per family ([`crate::nonstandard`]).
    Nonstandard,
    /// Vision encoder + text decoder.
    Vlm,
    /// Inspect the nested `text_config.model_type` first.
    Mistral3Dynamic,
}

/// How a model is built from weights already in memory (fused adapters, surgery).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightRoute {
    /// Through [`load_config_backed`], from a `WeightMap` of any origin.
    ConfigBacked,
    /// No route: the type can only be loaded from its folder.
    None,
}

/// Whether this build can load adapters: LoRA adapters (mlx-lm or PEFT) fused at load
/// (`mlxcel_loading::LoadOptions::adapter`) or kept unfused ([`crate::nn::lora`]), LoRA or DoRA,
/// on linear layers, stacked MoE experts and token embeddings (and a tied head through them).
pub const ADAPTERS_AVAILABLE: bool = true;

/// Whether adapters can be applied to `model_type`: the registry row's reason when the type rules
/// them out, else whether this build loads adapters at all.
pub fn adapter_support(model_type: ModelType) -> std::result::Result<(), String> {
    if let Some(reason) = model_type.descriptor().adapter_unsupported {
        return Err(reason.to_string());
    }
    if !ADAPTERS_AVAILABLE {
        return Err("this build does not load adapters yet".to_string());
    }
    Ok(())
}

/// The routing facts of one model type.
#[derive(Debug, Clone, Copy)]
pub struct StaticModelDescriptor {
    /// The registry row this describes.
    pub model_type: ModelType,
    /// The `config.json` `model_type` strings that map to this type (e.g. `["llama", "mistral"]`).
    pub names: &'static [&'static str],
    /// What the checkpoint is for (generation, embedding, reranker).
    pub kind: ModelKind,
    /// How a model folder of this type is loaded.
    pub directory_route: DirectoryRoute,
    /// How it is built from weights already in memory.
    pub weight_route: WeightRoute,
    /// The architecture type as written in the registry row (`stringify!`'d, with `$crate`);
    /// see [`StaticModelDescriptor::architecture_path`] for the readable path.
    pub architecture: &'static str,
    /// `Some(reason)` when the type itself rules adapters out (see [`adapter_support`]).
    pub adapter_unsupported: Option<&'static str>,
}

impl StaticModelDescriptor {
    /// The architecture's Rust path, e.g. `mlxcel_arch::models::llama::Model`.
    pub fn architecture_path(&self) -> String {
        self.architecture
            .replace(' ', "")
            .replace("$crate", "mlxcel_arch")
    }
}

/// The routing decisions for a detected model type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelLoadPolicy {
    /// How a model folder is loaded.
    pub directory_route: DirectoryRoute,
    /// How the model is built from weights already in memory.
    pub weight_route: WeightRoute,
}

/// How to build a model: the checkpoint's tensors, quantization and compute dtype.
#[derive(Debug)]
pub struct BuildOptions {
    /// The scope the model's tensors live under (`""` for a text checkpoint).
    pub prefix: String,
    /// The checkpoint's quantization (`quantization` / `quantization_config` in `config.json`);
    /// `None` for a dense checkpoint.
    pub quant: Option<QuantConfig>,
    /// The compute dtype: floating-point weights are cast to it and activations run in it.
    pub dtype: Dtype,
    /// When the kept tensors are evaluated (eagerly after building, or left lazy).
    pub materialization: Materialization,
    /// Stream the routed experts of the layers this covers instead of loading them.
    pub stream: Option<crate::weights::ExpertStreamSetup>,
    /// The per-layer-embedding table on disk (`ple_storage` in `config.json`, see
    /// `mlxcel_stream::ple`): the checkpoint's own copy, if any, is never loaded.
    pub external_ple: Option<std::rc::Rc<mlxcel_stream::ple::PleStore>>,
    /// Fuse linear layers that read the same input (q/k/v, gate/up) into one at load, when
    /// they share a storage format. Saves arrays and kernel launches per decode step (what
    /// bounds decode on a GPU) at the cost of one copy of those weights while loading.
    pub fuse_projections: bool,
    /// An edit of the sanitised tensors before construction (surgery, fused adapters).
    pub transform: Option<WeightTransform>,
    /// LoRA adapters kept unfused, attached to the linear layers they name (see
    /// [`crate::nn::lora`]).
    pub runtime_adapters: Option<crate::nn::lora::RuntimeAdapters>,
    /// This process's part of a model spread over several (tensor or pipeline parallelism,
    /// see [`crate::parallel`]); `None` builds the whole model.
    pub parallelism: Option<crate::parallel::Parallelism>,
    /// Build the multi-token-prediction layers the checkpoint carries (DeepSeek-V3, GLM-4.5),
    /// for self-speculative decoding ([`crate::model::MultiTokenPrediction`]); a model
    /// without them is an error. Off: they are skipped, never read.
    pub mtp: bool,
}

/// The signature of a [`WeightTransform`]: the sanitised tensors and the config they go with.
pub type WeightTransformFn = dyn Fn(&mut WeightMap, &mut Value) -> Result<()>;

/// A load-time edit of the checkpoint's tensors (weight surgery, fused adapters), run by
/// [`build_architecture`] on the sanitised [`WeightMap`] before the model is constructed.
/// An edit that changes shapes (a structural prune) updates the config to match, and the
/// architecture's args are re-read from it. It must leave both untouched when it fails.
#[derive(Clone)]
pub struct WeightTransform(pub std::rc::Rc<WeightTransformFn>);

impl std::fmt::Debug for WeightTransform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WeightTransform(..)")
    }
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
    let mut args: M::Args = parse_args(config)?;
    M::sanitize(&args, &mut weights, options.quant.as_ref())?;
    if let Some(transform) = &options.transform {
        let mut edited = config.clone();
        (transform.0)(&mut weights, &mut edited)?;
        if &edited != config {
            args = parse_args(&edited)?;
        }
    }
    if let Some(stream) = &options.stream {
        // Every field of each layer's manifest entry against the sanitised checkpoint's
        // headers (no tensor bytes read), before the stacks are dropped.
        for layer in &stream.manifest.layers {
            mlxcel_stream::manifest::check_layout(layer, &weights)?;
        }
        // Streamed experts stay on disk: drop their (still lazy, never evaluated) stacks.
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
    if options.external_ple.is_some() {
        // The table is read from disk: drop the checkpoint's (still lazy) copy and its planes.
        let base = mlxcel_stream::ple::PLE_TENSOR_SUFFIX.trim_end_matches(".weight");
        let table: Vec<String> = weights
            .names()
            .filter(|n| {
                [".weight", ".scales", ".biases"]
                    .iter()
                    .any(|p| n.ends_with(&format!("{base}{p}")))
            })
            .map(str::to_string)
            .collect();
        for n in table {
            weights.remove(&n);
        }
    }
    drop_unused_buffers(&mut weights);
    let mut w = ModelWeights::new(weights, options.quant.clone(), options.dtype)
        .with_stream(options.stream.clone())
        .with_external_ple(options.external_ple.clone())
        .with_fused_projections(options.fuse_projections)
        .with_runtime_adapters(options.runtime_adapters.clone())
        .with_parallelism(options.parallelism.clone())
        .with_mtp(options.mtp);
    let model = M::build(&args, &mut w.scope(&options.prefix))?;
    let kept = w.finish(name)?;
    options.materialization.apply(kept.iter())?;
    Ok(model)
}

/// Deserialises an architecture's args from the sanitised config; the error names the field.
/// Every architecture's config passes [`crate::validate::validate_config`] here first (types
/// and ranges of the known keys); a remaining serde error names the key it is about.
pub(crate) fn parse_args<A: serde::de::DeserializeOwned>(config: &Value) -> Result<A> {
    crate::validate::validate_config(config)?;
    serde_json::from_value(config.clone()).map_err(|e| {
        ModelError::Config(crate::validate::locate_serde_error::<A>(
            config,
            &e.to_string(),
        ))
    })
}

/// Collects the registry rows of kind `Generation` and generates [`GenerationModel`] over them
/// (rows of other kinds get their own kind's enum when those kinds land).
macro_rules! generation_models {
    (@rows [$($v:ident: $m:ty,)*]) => {
        /// A loaded text-generation model of any registered generation type, one variant per
        /// registry row of kind `Generation`; it implements [`LanguageModel`] by delegating to
        /// the architecture.
        pub enum GenerationModel { $(
            #[doc = concat!("A [`ModelType::", stringify!($v), "`] model.")]
            $v(Box<$m>)
        ),* }

        impl GenerationModel {
            /// The registry type of the loaded architecture.
            pub fn model_type(&self) -> ModelType {
                match self { $(GenerationModel::$v(_) => ModelType::$v),* }
            }
        }

        impl std::fmt::Debug for GenerationModel {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "GenerationModel({})", self.model_type().name())
            }
        }

        impl LanguageModel for GenerationModel {
            fn embed(&self, tokens: &mlxcel_core::Array) -> Result<mlxcel_core::Array> {
                match self { $(GenerationModel::$v(m) => m.embed(tokens)),* }
            }
            fn forward_embeddings(&self, embeddings: &mlxcel_core::Array, positions: Option<&mlxcel_core::Array>, caches: &mut [LayerCache], last_only: bool) -> Result<mlxcel_core::Array> {
                match self { $(GenerationModel::$v(m) => m.forward_embeddings(embeddings, positions, caches, last_only)),* }
            }
            // Token ids reach the architecture itself: some read more than the embeddings of
            // them (Gemma 3n's per-layer inputs).
            fn forward(&self, tokens: &mlxcel_core::Array, caches: &mut [LayerCache]) -> Result<mlxcel_core::Array> {
                match self { $(GenerationModel::$v(m) => m.forward(tokens, caches)),* }
            }
            fn forward_last(&self, tokens: &mlxcel_core::Array, caches: &mut [LayerCache]) -> Result<mlxcel_core::Array> {
                match self { $(GenerationModel::$v(m) => m.forward_last(tokens, caches)),* }
            }
            fn final_hidden_states(&self, embeddings: &mlxcel_core::Array, caches: &mut [LayerCache]) -> Result<mlxcel_core::Array> {
                match self { $(GenerationModel::$v(m) => m.final_hidden_states(embeddings, caches)),* }
            }
            fn vocab_size(&self) -> usize {
                match self { $(GenerationModel::$v(m) => m.vocab_size()),* }
            }
            fn prefetch(&self, next_tokens: &[u32]) -> Result<()> {
                match self { $(GenerationModel::$v(m) => m.prefetch(next_tokens)),* }
            }
            fn layer_schedule(&self) -> Vec<LayerKind> {
                match self { $(GenerationModel::$v(m) => m.layer_schedule()),* }
            }
            fn batched_decode(&self) -> bool {
                match self { $(GenerationModel::$v(m) => m.batched_decode()),* }
            }
            fn decodes_on_cpu_engine(&self) -> bool {
                match self { $(GenerationModel::$v(m) => m.decodes_on_cpu_engine()),* }
            }
            fn vision(&self) -> Option<&dyn $crate::vision::VisionLanguage> {
                match self { $(GenerationModel::$v(m) => m.vision()),* }
            }
            fn mtp(&self) -> Option<&dyn $crate::model::MultiTokenPrediction> {
                match self { $(GenerationModel::$v(m) => m.mtp()),* }
            }
        }

        fn build_generation(model_type: ModelType, config: &Value, weights: WeightMap, options: &BuildOptions) -> Result<LoadedModel> {
            match model_type {
                $(ModelType::$v => Ok(LoadedModel::Generation(GenerationModel::$v(Box::new(
                    build_architecture::<$m>(stringify!($v), config, weights, options)?
                ))))),*,
                #[allow(unreachable_patterns)]
                other => Err(ModelError::Unsupported(format!("{} is not a generation model", other.name()))),
            }
        }
    };
    (@rows [$($acc:tt)*] $v:ident { kind: Generation, model: $m:ty }, $($rest:tt)*) => {
        generation_models!(@rows [$($acc)* $v: $m,] $($rest)*);
    };
    (@rows [$($acc:tt)*] $v:ident { kind: $other:ident, model: $m:ty }, $($rest:tt)*) => {
        generation_models!(@rows [$($acc)*] $($rest)*);
    };
}

/// Collects the registry rows of kind `Embedding` and generates [`EmbeddingModelEnum`] over
/// them, the same way `generation_models!` does for `Generation` rows.
macro_rules! embedding_models {
    (@rows [$($v:ident: $m:ty,)*]) => {
        /// A loaded encoder of any registered embedding type, one variant per registry row of
        /// kind `Embedding`; it implements [`EmbeddingModel`] by delegating to the architecture.
        pub enum EmbeddingModelEnum { $(
            #[doc = concat!("A [`ModelType::", stringify!($v), "`] encoder.")]
            $v(Box<$m>)
        ),* }

        impl EmbeddingModelEnum {
            /// The registry type of the loaded encoder.
            pub fn model_type(&self) -> ModelType {
                match self { $(EmbeddingModelEnum::$v(_) => ModelType::$v),* }
            }
        }

        impl std::fmt::Debug for EmbeddingModelEnum {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "EmbeddingModelEnum({})", self.model_type().name())
            }
        }

        impl EmbeddingModel for EmbeddingModelEnum {
            fn hidden_states(&self, ids: &mlxcel_core::Array, mask: &mlxcel_core::Array) -> Result<mlxcel_core::Array> {
                match self { $(EmbeddingModelEnum::$v(m) => m.hidden_states(ids, mask)),* }
            }
            fn hidden_size(&self) -> usize {
                match self { $(EmbeddingModelEnum::$v(m) => m.hidden_size()),* }
            }
            fn vocab_size(&self) -> usize {
                match self { $(EmbeddingModelEnum::$v(m) => m.vocab_size()),* }
            }
            fn max_tokens(&self) -> Option<usize> {
                match self { $(EmbeddingModelEnum::$v(m) => m.max_tokens()),* }
            }
        }

        fn build_embedding(model_type: ModelType, config: &Value, weights: WeightMap, options: &BuildOptions) -> Result<LoadedModel> {
            match model_type {
                $(ModelType::$v => Ok(LoadedModel::Embedding(EmbeddingModelEnum::$v(Box::new(
                    build_architecture::<$m>(stringify!($v), config, weights, options)?
                ))))),*,
                #[allow(unreachable_patterns)]
                other => Err(ModelError::Unsupported(format!("{} is not an embedding model", other.name()))),
            }
        }
    };
    (@rows [$($acc:tt)*] $v:ident { kind: Embedding, model: $m:ty }, $($rest:tt)*) => {
        embedding_models!(@rows [$($acc)* $v: $m,] $($rest)*);
    };
    (@rows [$($acc:tt)*] $v:ident { kind: $other:ident, model: $m:ty }, $($rest:tt)*) => {
        embedding_models!(@rows [$($acc)*] $($rest)*);
    };
}

/// Collects the registry rows of kind `Reranker` and generates [`RerankerModelEnum`] over them,
/// the same way `embedding_models!` does for `Embedding` rows.
macro_rules! reranker_models {
    (@rows [$($v:ident: $m:ty,)*]) => {
        /// A loaded cross-encoder of any registered reranker type, one variant per registry row
        /// of kind `Reranker`; it implements [`RerankerModel`] by delegating to the architecture.
        pub enum RerankerModelEnum { $(
            #[doc = concat!("A [`ModelType::", stringify!($v), "`] cross-encoder.")]
            $v(Box<$m>)
        ),* }

        impl RerankerModelEnum {
            /// The registry type of the loaded cross-encoder.
            pub fn model_type(&self) -> ModelType {
                match self { $(RerankerModelEnum::$v(_) => ModelType::$v),* }
            }
        }

        impl std::fmt::Debug for RerankerModelEnum {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "RerankerModelEnum({})", self.model_type().name())
            }
        }

        impl RerankerModel for RerankerModelEnum {
            fn logits(&self, ids: &mlxcel_core::Array, type_ids: &mlxcel_core::Array, mask: &mlxcel_core::Array) -> Result<mlxcel_core::Array> {
                match self { $(RerankerModelEnum::$v(m) => m.logits(ids, type_ids, mask)),* }
            }
            fn num_labels(&self) -> usize {
                match self { $(RerankerModelEnum::$v(m) => m.num_labels()),* }
            }
            fn uses_token_types(&self) -> bool {
                match self { $(RerankerModelEnum::$v(m) => m.uses_token_types()),* }
            }
            fn vocab_size(&self) -> usize {
                match self { $(RerankerModelEnum::$v(m) => m.vocab_size()),* }
            }
            fn max_tokens(&self) -> Option<usize> {
                match self { $(RerankerModelEnum::$v(m) => m.max_tokens()),* }
            }
        }

        fn build_reranker(model_type: ModelType, config: &Value, weights: WeightMap, options: &BuildOptions) -> Result<LoadedModel> {
            match model_type {
                $(ModelType::$v => Ok(LoadedModel::Reranker(RerankerModelEnum::$v(Box::new(
                    build_architecture::<$m>(stringify!($v), config, weights, options)?
                ))))),*,
                #[allow(unreachable_patterns)]
                other => Err(ModelError::Unsupported(format!("{} is not a reranker", other.name()))),
            }
        }
    };
    (@rows [$($acc:tt)*] $v:ident { kind: Reranker, model: $m:ty }, $($rest:tt)*) => {
        reranker_models!(@rows [$($acc)* $v: $m,] $($rest)*);
    };
    (@rows [$($acc:tt)*] $v:ident { kind: $other:ident, model: $m:ty }, $($rest:tt)*) => {
        reranker_models!(@rows [$($acc)*] $($rest)*);
    };
}

/// Generates [`ModelType`], [`DESCRIPTORS`], [`GenerationModel`] and the per-type dispatch
/// functions from the rows of [`for_each_model_registration!`](crate::for_each_model_registration).
macro_rules! define_registry {
    ($( $variant:ident { names: [$($name:literal),+], kind: $kind:ident, dir: $dir:ident, weights: $weights:ident, model: $model:ty, adapter: $adapter:expr } ),* $(,)?) => {
        /// Every registered model type: one variant per row of
        /// [`for_each_model_registration!`](crate::for_each_model_registration).
        ///
        /// ```
        /// use mlxcel_arch::ModelType;
        ///
        /// // `config.json` `model_type` strings map to registry rows (several may share one).
        /// assert_eq!(ModelType::from_model_type("llama"), Some(ModelType::Llama));
        /// assert_eq!(ModelType::from_model_type("mistral"), Some(ModelType::Llama));
        /// assert_eq!(ModelType::from_model_type("not-a-model"), None);
        /// assert_eq!(ModelType::Llama.name(), "Llama");
        /// assert!(ModelType::Llama.descriptor().names.contains(&"llama"));
        /// ```
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum ModelType { $(
            #[doc = concat!("`", stringify!($variant), "`: `config.json` `model_type`", $(" `", $name, "`",)+ ".")]
            $variant
        ),* }

        impl ModelType {
            /// Every registered type, in registry order (the order of [`DESCRIPTORS`]).
            pub const ALL: &'static [ModelType] = &[$(ModelType::$variant),*];

            /// The variant's name (e.g. `"Llama"`), used in logs and error messages; not the
            /// `config.json` string (see [`StaticModelDescriptor::names`]).
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

            /// This type's registry row: names, kind and routes.
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

        generation_models!(@rows [] $($variant { kind: $kind, model: $model },)*);
        embedding_models!(@rows [] $($variant { kind: $kind, model: $model },)*);
        reranker_models!(@rows [] $($variant { kind: $kind, model: $model },)*);

        /// The per-layer cache schedule `model_type`'s config implies (no weights needed).
        pub fn cache_schedule(model_type: ModelType, config: &Value) -> Result<Vec<LayerKind>> {
            match model_type {
                $(ModelType::$variant => <$model as Architecture>::cache_schedule(&parse_args(config)?)),*
            }
        }

        /// A checkpoint's tensors after its architecture's sanitiser (experts stacked into
        /// `switch_mlp`, ...): what the expert-stream writer slices.
        pub fn sanitized_weights(model_type: ModelType, config: &Value, mut weights: WeightMap) -> Result<WeightMap> {
            match model_type {
                $(ModelType::$variant => {
                    let args: <$model as Architecture>::Args = parse_args(config)?;
                    let quant = QuantConfig::from_config(config)?;
                    <$model as Architecture>::sanitize(&args, &mut weights, quant.as_ref())?;
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
            match descriptor.kind {
                ModelKind::Generation => build_generation(model_type, config, weights, options),
                ModelKind::Embedding => build_embedding(model_type, config, weights, options),
                ModelKind::Reranker => build_reranker(model_type, config, weights, options),
            }
        }
    };
}

for_each_model_registration!(define_registry);

/// A loaded model, by kind: each kind has its own trait, so an encoder is never forced through
/// [`LanguageModel`].
#[derive(Debug)]
pub enum LoadedModel {
    /// Token ids (or input embeddings) in, next-token logits out.
    Generation(GenerationModel),
    /// Token ids and an attention mask in, hidden states (and pooled embeddings) out.
    Embedding(EmbeddingModelEnum),
    /// Query/document pairs (ids, token types, mask) in, relevance logits out.
    Reranker(RerankerModelEnum),
}

impl LoadedModel {
    /// The registry type of the loaded model.
    pub fn model_type(&self) -> ModelType {
        match self {
            LoadedModel::Generation(m) => m.model_type(),
            LoadedModel::Embedding(m) => m.model_type(),
            LoadedModel::Reranker(m) => m.model_type(),
        }
    }

    /// What the loaded model is for.
    pub fn kind(&self) -> ModelKind {
        match self {
            LoadedModel::Generation(_) => ModelKind::Generation,
            LoadedModel::Embedding(_) => ModelKind::Embedding,
            LoadedModel::Reranker(_) => ModelKind::Reranker,
        }
    }

    fn wrong_kind(&self, wanted: &str) -> ModelError {
        ModelError::Unsupported(format!(
            "{} is a {:?} model, not {wanted}",
            self.model_type().name(),
            self.kind()
        ))
    }

    /// The model as a text generator, or an error naming its kind.
    pub fn generation(&self) -> Result<&GenerationModel> {
        match self {
            LoadedModel::Generation(m) => Ok(m),
            other => Err(other.wrong_kind("a generation model")),
        }
    }

    /// Like [`LoadedModel::generation`], by value.
    pub fn into_generation(self) -> Result<GenerationModel> {
        match self {
            LoadedModel::Generation(m) => Ok(m),
            other => Err(other.wrong_kind("a generation model")),
        }
    }

    /// The model as an encoder, or an error naming its kind.
    pub fn embedding(&self) -> Result<&EmbeddingModelEnum> {
        match self {
            LoadedModel::Embedding(m) => Ok(m),
            other => Err(other.wrong_kind("an embedding model")),
        }
    }

    /// Like [`LoadedModel::embedding`], by value.
    pub fn into_embedding(self) -> Result<EmbeddingModelEnum> {
        match self {
            LoadedModel::Embedding(m) => Ok(m),
            other => Err(other.wrong_kind("an embedding model")),
        }
    }

    /// The model as a cross-encoder, by value, or an error naming its kind.
    pub fn into_reranker(self) -> Result<RerankerModelEnum> {
        match self {
            LoadedModel::Reranker(m) => Ok(m),
            other => Err(other.wrong_kind("a reranker")),
        }
    }
}

/// The registry as a markdown table, one row per registered type in registry order: what the
/// README's architecture list is (a test keeps the two the same).
pub fn registry_markdown() -> String {
    let mut out = String::from(
        "| type | `model_type` (or `architectures`) | kind | folder route | adapters |\n|---|---|---|---|---|\n",
    );
    for d in DESCRIPTORS {
        let names: Vec<String> = d.names.iter().map(|n| format!("`{n}`")).collect();
        out.push_str(&format!(
            "| {} | {} | {:?} | {:?} | {} |\n",
            d.model_type.name(),
            names.join(", "),
            d.kind,
            d.directory_route,
            if adapter_support(d.model_type).is_ok() {
                "yes"
            } else {
                "no"
            },
        ));
    }
    out
}

/// The routing decisions for `model_type`, from its registry row.
pub fn model_load_policy(model_type: ModelType) -> ModelLoadPolicy {
    let d = model_type.descriptor();
    ModelLoadPolicy {
        directory_route: d.directory_route,
        weight_route: d.weight_route,
    }
}
