//! Checkpoint rewrites shared by several architectures' `sanitize` (mlx-lm's catalogue of
//! checkpoint quirks is the model for these).

use mlxcel_core::WeightMap;

use crate::{ModelError, Result};

/// Stacks per-expert tensors into the layout the model runs: for each `(from, to)` pair and each
/// plane (`weight`, `scales`, `biases`), `{prefix}.{experts}.{e}.{from}.{plane}` for `e` in
/// `0..n` becomes `{prefix}.switch_mlp.{to}.{plane}` of shape `[n, ..]`. Checkpoints already
/// stacked (MLX conversions) are left as they are.
pub fn stack_experts(
    map: &mut WeightMap,
    prefix: &str,
    experts: &str,
    n: usize,
    names: &[(&str, &str)],
) -> Result<()> {
    for (from, to) in names {
        for plane in ["weight", "scales", "biases"] {
            let name = |e: usize| format!("{prefix}.{experts}.{e}.{from}.{plane}");
            if !map.contains(&name(0)) {
                continue;
            }
            let mut parts = Vec::with_capacity(n);
            for e in 0..n {
                let part = name(e);
                if !map.contains(&part) {
                    return Err(ModelError::MissingTensor(part));
                }
                parts.push(part);
            }
            // A lazy stack: a tensor-parallel rank then reads only its columns of each expert.
            map.stack(format!("{prefix}.switch_mlp.{to}.{plane}"), &parts)?;
        }
    }
    Ok(())
}

/// The common HF MoE layout: `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj`.
pub fn stack_mlp_experts(map: &mut WeightMap, layers: usize, experts: usize) -> Result<()> {
    for i in 0..layers {
        stack_experts(
            map,
            &format!("model.layers.{i}.mlp"),
            "experts",
            experts,
            &[
                ("gate_proj", "gate_proj"),
                ("up_proj", "up_proj"),
                ("down_proj", "down_proj"),
            ],
        )?;
    }
    Ok(())
}

/// Splits a fused projection `{from}` into consecutive row blocks `(to, rows)`, for every plane
/// stored (`weight`, quantized `scales`/`biases`, `bias`): output rows are independent, so
/// quantized planes split along the same rows. A checkpoint without `{from}.weight` is left as
/// it is (already split).
pub fn split_rows(map: &mut WeightMap, from: &str, parts: &[(&str, i32)]) -> Result<()> {
    if !map.contains(&format!("{from}.weight")) {
        return Ok(());
    }
    let total: i32 = parts.iter().map(|(_, rows)| rows).sum();
    let mut cuts = Vec::with_capacity(parts.len());
    let mut at = 0;
    for (_, rows) in &parts[..parts.len() - 1] {
        at += rows;
        cuts.push(at);
    }
    for plane in ["weight", "scales", "biases", "bias"] {
        let name = format!("{from}.{plane}");
        if !map.contains(&name) {
            continue;
        }
        let fused = map.take(&name)?;
        if fused.dim(0)? != total {
            return Err(ModelError::Shape {
                tensor: name,
                found: fused.shape(),
                expected: vec![total],
            });
        }
        for ((to, _), piece) in parts.iter().zip(fused.split_at(&cuts, 0)?) {
            map.insert(format!("{to}.{plane}"), piece)?;
        }
    }
    Ok(())
}

/// Splits a projection `{from}` whose output rows come in `groups` groups of `[first | second]`
/// (each `rows` rows wide) — Qwen3-Next's `q_proj`, which interleaves every head's query with
/// its output gate — into `first` and `second`, for every plane stored (`weight`, quantized
/// `scales`/`biases`, `bias`). A checkpoint without `{from}.weight` is left as it is.
pub fn split_interleaved_rows(
    map: &mut WeightMap,
    from: &str,
    groups: i32,
    rows: i32,
    (first, second): (&str, &str),
) -> Result<()> {
    if !map.contains(&format!("{from}.weight")) {
        return Ok(());
    }
    for plane in ["weight", "scales", "biases", "bias"] {
        let name = format!("{from}.{plane}");
        if !map.contains(&name) {
            continue;
        }
        let fused = map.take(&name)?;
        let shape = fused.shape();
        if shape.first() != Some(&(groups * 2 * rows)) {
            return Err(ModelError::Shape {
                tensor: name,
                found: shape,
                expected: vec![groups * 2 * rows],
            });
        }
        let mut grouped = vec![groups, 2 * rows];
        grouped.extend_from_slice(&shape[1..]);
        let mut half = shape.clone();
        half[0] = groups * rows;
        let fused = fused.reshape(&grouped)?;
        for (to, start) in [(first, 0), (second, rows)] {
            let part = fused.slice_axis(1, start, start + rows)?.reshape(&half)?;
            map.insert(format!("{to}.{plane}"), part)?;
        }
    }
    Ok(())
}

/// Renames the norms and modules of each layer from `pairs` (`from` → `to`, applied in order, so
/// a name may be freed before it is reused).
pub fn rename_in_layers(map: &mut WeightMap, layers: usize, pairs: &[(&str, &str)]) -> Result<()> {
    for i in 0..layers {
        for (from, to) in pairs {
            map.rename_prefix(
                &format!("model.layers.{i}.{from}."),
                &format!("model.layers.{i}.{to}."),
            )?;
        }
    }
    Ok(())
}

/// Drops buffers no inference path reads (rotary frequency caches some exporters save).
pub fn drop_unused_buffers(map: &mut WeightMap) {
    let names: Vec<String> = map
        .names()
        .filter(|n| n.ends_with(".rotary_emb.inv_freq"))
        .map(str::to_string)
        .collect();
    for n in names {
        map.remove(&n);
    }
}

/// Brings depthwise convolution weights (`*.conv1d.weight`) stored in MLX's `[channels, kernel,
/// 1]` layout (mlx-lm conversions of state-space models) to PyTorch's `[channels, 1, kernel]`,
/// the layout the builders read. PyTorch-layout checkpoints are left as they are.
pub fn conv_weights_to_torch_layout(map: &mut WeightMap) -> Result<()> {
    let names: Vec<String> = map
        .names()
        .filter(|n| n.ends_with(".conv1d.weight"))
        .map(str::to_string)
        .collect();
    for name in names {
        let shape = map.info(&name).map(|i| i.shape.clone()).unwrap_or_default();
        if shape.len() == 3 && shape[2] == 1 && shape[1] > 1 {
            let w = map.take(&name)?;
            map.insert(name, w.transpose(&[0, 2, 1])?)?;
        }
    }
    Ok(())
}

/// How many layers the checkpoint stores as `model.layers.{i}` with `i >= layers`: the
/// multi-token-prediction layers DeepSeek-V3 and GLM-4.5 keep after the last decoder layer,
/// which their sanitisers rewrite like the others (stacked experts, renames) so they can be
/// built on request.
pub fn layers_after(map: &WeightMap, layers: usize) -> usize {
    map.names()
        .filter_map(|name| {
            name.strip_prefix("model.layers.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|i| i.parse::<usize>().ok())
                .filter(|i| *i >= layers)
        })
        .collect::<std::collections::BTreeSet<_>>()
        .len()
}
