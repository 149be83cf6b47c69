//! `mlxcel inspect` and `mlxcel arch`: what a checkpoint holds, and what the registry knows.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mlxcel_arch::detection::{detect_kind, get_model_type, get_reranker_type};
use mlxcel_arch::{model_load_policy, DESCRIPTORS};
use mlxcel_core::WeightMap;
use mlxcel_loading::memory::tensor_role as role;
use mlxcel_loading::{read_config, resolve_model_dir};
use mlxcel_quant::infer_quantization_bits;

#[derive(Default)]
struct RoleStats {
    params: u64,
    bytes: u64,
    formats: BTreeMap<String, u64>,
}

pub fn run(path: &Path) -> anyhow::Result<()> {
    let folder = resolve_model_dir(path)?;
    let config = read_config(&folder)?;
    let kind = detect_kind(&config, folder.join("modules.json").is_file());
    let weights = WeightMap::open(&folder)?;
    println!("model     {}", folder.display());
    println!("kind      {kind:?}");
    // A cross-encoder shares its backbone's model_type: its row is found by architecture.
    let model_type = if kind == mlxcel_arch::ModelKind::Reranker {
        get_reranker_type(&config)
    } else {
        get_model_type(&config, false)
    };
    match model_type.as_ref() {
        Ok(&t) => {
            let p = model_load_policy(t);
            println!(
                "type      {} ({})",
                t.name(),
                t.descriptor().architecture_path()
            );
            println!(
                "routes    directory {:?}, weights {:?}",
                p.directory_route, p.weight_route
            );
        }
        Err(e) => println!("type      unsupported: {e}"),
    }
    // A vision-language checkpoint loaded with its tower keeps it on disk until the first image.
    let has_vision = weights.names().any(|n| role(n) == "vision (unused)");
    let lazy_tower = model_type.as_ref().is_ok_and(|t| {
        matches!(
            t.descriptor().directory_route,
            mlxcel_arch::DirectoryRoute::Vlm | mlxcel_arch::DirectoryRoute::Mistral3Dynamic
        ) && !mlxcel_arch::detection::is_text_only(&config, has_vision)
    });
    let role = |name: &str| match role(name) {
        "vision (unused)" if lazy_tower => "vision (lazy)",
        other => other,
    };
    let quant = mlxcel_quant::QuantConfig::from_config(&config)?;
    let group = quant.as_ref().map_or(64, |q| q.group_size);
    let mut roles: BTreeMap<&str, RoleStats> = BTreeMap::new();
    let names: Vec<String> = weights.names().map(str::to_string).collect();
    for name in &names {
        if name.ends_with(".scales") || name.ends_with(".biases") {
            continue;
        }
        let info = weights.info(name).expect("listed name");
        let stats = roles.entry(role(name)).or_default();
        let base = name.trim_end_matches(".weight");
        let scales = weights.info(&format!("{base}.scales"));
        let mut bytes = info.nbytes() as u64;
        let (params, format) = match scales {
            Some(s) => {
                let mode = quant
                    .as_ref()
                    .map(|q| q.mode)
                    .unwrap_or(mlxcel_quant::QuantMode::Affine);
                let bits = match mode.fixed_layout() {
                    Some((_, b)) => b,
                    None => {
                        infer_quantization_bits(name, &info.shape, &s.shape, group, 4).unwrap_or(0)
                    }
                };
                bytes += s.nbytes() as u64;
                if let Some(b) = weights.info(&format!("{base}.biases")) {
                    bytes += b.nbytes() as u64;
                }
                let packed = info.numel() as u64;
                (
                    packed * 32 / bits.max(1) as u64,
                    format!("{mode} {bits}-bit"),
                )
            }
            None => (info.numel() as u64, info.stored_dtype.to_lowercase()),
        };
        stats.params += params;
        stats.bytes += bytes;
        *stats.formats.entry(format).or_default() += params;
    }
    // An external per-layer-embedding table is on disk: its parameters count, while the bytes
    // held are its row cache (or, with MLXCEL_PLE_IO=ram, the table).
    let policy = mlxcel_core::policy::current();
    if let Some(line) = mlxcel_loading::ple::describe_footprint(&folder, &config, &policy)? {
        println!("ple       {line}");
        if let (Some(table), Some((held, _))) = (
            roles.remove("per-layer embed"),
            mlxcel_loading::ple::footprint(&folder, &config, &policy)?,
        ) {
            roles.insert(
                "per-layer embed (row cache)",
                RoleStats {
                    bytes: held,
                    ..table
                },
            );
        }
    }
    let total_params: u64 = roles.values().map(|r| r.params).sum();
    let total_bytes: u64 = roles.values().map(|r| r.bytes).sum();
    println!(
        "params    {total_params} ({:.1}M), {total_bytes} bytes ({:.2} bits/param)",
        total_params as f64 / 1e6,
        total_bytes as f64 * 8.0 / total_params.max(1) as f64
    );
    println!("{:<16} {:>12} {:>12}  formats", "role", "params", "bytes");
    for (role, s) in &roles {
        let formats: Vec<String> = s
            .formats
            .iter()
            .map(|(f, n)| format!("{f} ({:.0}%)", *n as f64 * 100.0 / s.params.max(1) as f64))
            .collect();
        println!(
            "{role:<16} {:>12} {:>12}  {}",
            s.params,
            s.bytes,
            formats.join(", ")
        );
    }
    Ok(())
}

/// Loads the model with the given surgery and adapter (nothing is written) and prints what each
/// applied, one `edit` line each: the checks and messages of a real load.
pub fn edits(
    path: &Path,
    surgery: Option<PathBuf>,
    adapter: Option<PathBuf>,
    lora_fuse: bool,
) -> anyhow::Result<()> {
    let loaded = mlxcel_loading::load_model(
        path,
        &mlxcel_loading::LoadOptions {
            skip_tokenizer: true,
            policy: Some(mlxcel_core::policy::current()),
            surgery,
            adapter,
            lora_fuse,
            ..Default::default()
        },
    )?;
    for line in &loaded.surgery_applied {
        println!("edit      {line}");
    }
    Ok(())
}

pub fn print_registry() {
    println!(
        "{:<12} {:<22} {:<11} {:<15} {:<12} {:<8} architecture",
        "type", "model_type", "kind", "directory", "weights", "adapters"
    );
    for d in DESCRIPTORS {
        println!(
            "{:<12} {:<22} {:<11} {:<15} {:<12} {:<8} {}",
            d.model_type.name(),
            d.names.join(","),
            format!("{:?}", d.kind),
            format!("{:?}", d.directory_route),
            format!("{:?}", d.weight_route),
            if mlxcel_arch::adapter_support(d.model_type).is_ok() {
                "yes"
            } else {
                "no"
            },
            d.architecture_path()
        );
    }
}
