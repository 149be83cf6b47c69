//! State-space and hybrid models beyond the parity check (`parity.rs` covers their logits and
//! chunked-prefill greedy ids): prefix reuse across a divergence through recurrent-state
//! snapshots, the snapshot budget, and the state cache's size.

use mlxcel_arch::generate::{Session, SnapshotPolicy};
use mlxcel_arch::{LanguageModel, LayerCache, LayerKind};
use mlxcel_loading::{load_model, LoadOptions, Loaded};
use mlxcel_tests::{
    distances_to_transformers_and_mlx_lm, edit_config, load_without_tokenizer, max_abs_diff,
    model_dir, reference,
};

fn load(name: &str) -> Loaded {
    load_without_tokenizer(model_dir(name))
}

/// The fixture's prompt, and a second prompt sharing its first `keep` tokens and then
/// diverging (the rest of the prompt reversed, so the new tail differs at `keep`).
fn prompts(name: &str, keep: usize) -> (Vec<u32>, Vec<u32>) {
    let first = reference(name).prompt_ids;
    let mut second = first[..keep].to_vec();
    second.extend(first[keep..].iter().rev());
    assert_ne!(first[keep], second[keep]);
    (first, second)
}

fn policy(interval: usize, max_snapshots: usize) -> SnapshotPolicy {
    SnapshotPolicy {
        interval,
        max_snapshots,
    }
}

/// A second prompt diverging at token 27 resumes from the snapshot at 24 and gives the same
/// logits as a fresh prefill; without snapshots nothing is reused.
fn resumes_from_the_last_snapshot(name: &str) {
    let loaded = load(name);
    let model = &loaded.model;
    let (first, second) = prompts(name, 27);
    for chunk in [None, Some(3)] {
        let mut session = Session::new(model).with_snapshots(policy(8, 16));
        let (reused, _) = session.prefill(&first, chunk).unwrap();
        assert_eq!(reused, 0);
        assert_eq!(session.snapshot_positions(), vec![8, 16, 24, 32, 40]);
        let (reused, resumed) = session.prefill(&second, chunk).unwrap();
        assert_eq!(reused, 24, "{name}: chunk {chunk:?}");
        // Snapshots past the divergence are gone; the new prompt's own are taken.
        assert_eq!(session.snapshot_positions(), vec![8, 16, 24, 32, 40]);
        let mut fresh = Session::new(model).with_snapshots(policy(8, 16));
        let (_, expected) = fresh.prefill(&second, chunk).unwrap();
        let (d, _) = max_abs_diff(
            &resumed.to_vec::<f32>().unwrap(),
            &expected.to_vec::<f32>().unwrap(),
        );
        assert!(d <= 1e-6, "{name}: resumed logits differ by {d:.2e}");
        // And the continuation from the resumed state matches the fresh one's.
        let token = mlxcel_arch::generate::argmax_token(&resumed).unwrap();
        let next = session.step(token).unwrap();
        let next_fresh = fresh.step(token).unwrap();
        let (d, _) = max_abs_diff(
            &next.to_vec::<f32>().unwrap(),
            &next_fresh.to_vec::<f32>().unwrap(),
        );
        assert!(
            d <= 1e-6,
            "{name}: decode after resuming differs by {d:.2e}"
        );
        eprintln!(
            "{name}: chunk {chunk:?}: reused {reused} of {} tokens",
            second.len()
        );
    }
    // With snapshots off, a recurrent model cannot reuse across the divergence.
    let mut session = Session::new(model).with_snapshots(policy(8, 0));
    session.prefill(&first, None).unwrap();
    assert!(session.snapshot_positions().is_empty());
    let (reused, _) = session.prefill(&second, None).unwrap();
    assert_eq!(reused, 0);
}

#[test]
fn mamba_prefix_reuse_resumes_from_a_snapshot() {
    resumes_from_the_last_snapshot("mamba");
}

#[test]
fn mamba2_prefix_reuse_resumes_from_a_snapshot() {
    resumes_from_the_last_snapshot("mamba2");
}

#[test]
fn jamba_prefix_reuse_restores_mamba_layers_and_rewinds_attention() {
    resumes_from_the_last_snapshot("jamba");
}

#[test]
fn qwen3_next_prefix_reuse_restores_delta_layers_and_rewinds_attention() {
    resumes_from_the_last_snapshot("qwen3_next");
}

#[test]
fn qwen3_5_moe_prefix_reuse_restores_delta_layers_and_rewinds_attention() {
    resumes_from_the_last_snapshot("qwen3_5_moe_text");
}

#[test]
fn rwkv7_prefix_reuse_resumes_from_a_snapshot() {
    resumes_from_the_last_snapshot("rwkv7");
}

#[test]
fn nemotron_h_prefix_reuse_restores_mamba_layers_and_rewinds_attention() {
    resumes_from_the_last_snapshot("nemotron_h");
}

/// Falcon-H1's layers each hold keys and values and a Mamba-2 state: the snapshot restores the
/// states and the keys are cut back.
#[test]
fn falcon_h1_prefix_reuse_restores_states_and_rewinds_the_same_layers_attention() {
    resumes_from_the_last_snapshot("falcon_h1");
}

/// RecurrentGemma's local attention keeps a ring of 8 positions, which cannot be cut back to
/// the snapshot at 24 once it has moved on to 40: its snapshots hold the rings as well.
#[test]
fn recurrent_gemma_prefix_reuse_restores_rg_lru_layers_and_attention_rings() {
    resumes_from_the_last_snapshot("recurrent_gemma");
}

#[test]
fn appending_to_the_conversation_reuses_everything_without_a_snapshot() {
    let loaded = load("mamba");
    let model = &loaded.model;
    let (first, _) = prompts("mamba", 27);
    let mut session = Session::new(model).with_snapshots(policy(8, 0));
    session.prefill(&first[..30], None).unwrap();
    // The state is exactly at the end of the common prefix: it needs no rewinding.
    let (reused, logits) = session.prefill(&first, None).unwrap();
    assert_eq!(reused, 30);
    let (_, expected) = Session::new(model).prefill(&first, None).unwrap();
    let (d, _) = max_abs_diff(
        &logits.to_vec::<f32>().unwrap(),
        &expected.to_vec::<f32>().unwrap(),
    );
    assert!(d <= 1e-4, "appended prefill differs by {d:.2e}");
}

#[test]
fn snapshots_stay_within_their_budget_and_spread_out() {
    let loaded = load("mamba");
    let model = &loaded.model;
    let (first, second) = prompts("mamba", 33);
    let mut session = Session::new(model).with_snapshots(policy(4, 3));
    session.prefill(&first, None).unwrap();
    let kept = session.snapshot_positions();
    assert_eq!(kept.len(), 3, "{kept:?}");
    assert_eq!(*kept.last().unwrap(), 40, "the newest is kept: {kept:?}");
    // The diverging prompt resumes from the last kept snapshot at or before 33.
    let best = kept.iter().copied().filter(|p| *p <= 33).max().unwrap_or(0);
    let (reused, _) = session.prefill(&second, None).unwrap();
    assert_eq!(reused, best, "{kept:?}");
}

#[test]
fn state_caches_hold_a_fixed_size() {
    let loaded = load("jamba");
    let model = &loaded.model;
    let schedule = model.layer_schedule();
    assert!(
        matches!(schedule[0], LayerKind::Recurrent { .. }),
        "{schedule:?}"
    );
    assert!(
        matches!(schedule[1], LayerKind::GlobalAttention { .. }),
        "{schedule:?}"
    );
    // Layer 0: conv window (4 - 1) x 128 channels, state 128 x 8, in float32.
    assert_eq!(
        schedule[0].fixed_bytes(mlxcel_core::Dtype::Float32),
        (3 * 128 + 128 * 8) * 4
    );
    assert_eq!(schedule[0].bytes_per_token(mlxcel_core::Dtype::Float32), 0);
    let mut session = Session::new(model);
    let prompt = reference("jamba").prompt_ids;
    session.prefill(&prompt[..10], None).unwrap();
    let state_bytes = session.caches()[0].nbytes();
    session.prefill(&prompt, None).unwrap();
    assert_eq!(session.caches()[0].nbytes(), state_bytes);
    assert!(matches!(session.caches()[0], LayerCache::State(_)));
    assert_eq!(
        state_bytes as u64,
        schedule[0].fixed_bytes(mlxcel_core::Dtype::Float32)
    );
}

#[test]
fn the_stats_line_reports_the_snapshot_prefix_as_reused() {
    use mlxcel_loading::{generate_text, GenerateRequest};
    let loaded = load("mamba2");
    let (first, second) = prompts("mamba2", 20);
    let mut session = loaded.session().with_snapshots(policy(16, 4));
    let request = GenerateRequest {
        max_new_tokens: 4,
        ..GenerateRequest::for_model(&loaded)
    };
    let (_, stats) = generate_text(&mut session, None, &first, &request, |_| {}, |_| {}).unwrap();
    assert_eq!(stats.reused_tokens, 0);
    let (ids, stats) =
        generate_text(&mut session, None, &second, &request, |_| {}, |_| {}).unwrap();
    assert_eq!(stats.reused_tokens, 16);
    assert_eq!(stats.prompt_tokens, second.len());
    // The reply equals a fresh session's.
    let mut fresh = loaded.session();
    let (fresh_ids, _) =
        generate_text(&mut fresh, None, &second, &request, |_| {}, |_| {}).unwrap();
    assert_eq!(ids, fresh_ids);
}

/// mlx-lm's Jamba renormalises the top-k routing weights; transformers (the reference) keeps
/// the top-k of the softmax over all experts unnormalised. mlxcel follows transformers, so its
/// logits sit far from mlx-lm's (`models/jamba/mlx_lm_logits.safetensors`, see
/// `generate.py --stage mlx-lm-diffs`).
#[test]
fn jamba_follows_transformers_where_mlx_lm_renormalises_the_routing() {
    let (to_transformers, to_mlx_lm) = distances_to_transformers_and_mlx_lm("jamba");
    assert!(to_transformers < 1e-3, "{to_transformers:.2e}");
    assert!(
        to_mlx_lm > 1.0,
        "mlx-lm's routing now matches? {to_mlx_lm:.3}"
    );
}

/// mlx-lm's RecurrentGemma scales the embeddings by the exact `sqrt(hidden)` and normalises the
/// first position's RG-LRU input; transformers (followed here) keeps the normaliser in bfloat16
/// and leaves the first input unnormalised (`models/recurrent_gemma/mlx_lm_diff.json`).
#[test]
fn recurrent_gemma_follows_transformers_where_mlx_lm_normalises_differently() {
    let (to_transformers, to_mlx_lm) = distances_to_transformers_and_mlx_lm("recurrent_gemma");
    assert!(to_transformers < 2e-4, "{to_transformers:.2e}");
    assert!(
        to_mlx_lm > 1e-3,
        "mlx-lm's recurrent_gemma now matches transformers? {to_mlx_lm:.2e}"
    );
}

/// mlx-lm's Falcon-H1 drops muP multipliers transformers applies (and differs further); mlxcel
/// follows transformers (`models/falcon_h1/mlx_lm_diff.json`).
#[test]
fn falcon_h1_follows_transformers_where_mlx_lm_differs() {
    let (to_transformers, to_mlx_lm) = distances_to_transformers_and_mlx_lm("falcon_h1");
    assert!(to_transformers < 2e-4, "{to_transformers:.2e}");
    assert!(
        to_mlx_lm > 1.0,
        "mlx-lm's falcon_h1 now matches transformers? {to_mlx_lm:.3}"
    );
}

/// Prefills `prompt` in chunks of `chunk` (one pass for `None`): the last position's logits
/// and every state cache's arrays, flattened.
fn prefill_states(
    name: &str,
    model: &mlxcel_arch::GenerationModel,
    prompt: &[u32],
    chunk: Option<usize>,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let mut caches = model.make_caches();
    let logits = mlxcel_arch::generate::prefill(model, prompt, &mut caches, chunk)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    // Recurrent layers' states, Falcon-H1's (next to its keys) included.
    let states: Vec<Vec<f32>> = caches
        .iter()
        .filter_map(|c| match c {
            LayerCache::State(_) => Some(c),
            LayerCache::Pair(pair) => Some(&pair.1),
            _ => None,
        })
        .map(|c| {
            c.planes()
                .into_iter()
                .flat_map(|a| {
                    a.astype(mlxcel_core::Dtype::Float32)
                        .unwrap()
                        .to_vec::<f32>()
                        .unwrap()
                })
                .collect()
        })
        .collect();
    assert!(!states.is_empty(), "{name}: no state caches");
    (logits, states)
}

/// `prompt` prefilled in each of `chunks` leaves the logits and states of one pass.
fn chunked_equals_one_pass(name: &str, prompt: &[u32], chunks: &[usize]) {
    let loaded = load(name);
    let model = &loaded.model;
    let (logits, states) = prefill_states(name, model, prompt, None);
    for &chunk in chunks {
        let (l, s) = prefill_states(name, model, prompt, Some(chunk));
        let (d, _) = max_abs_diff(&l, &logits);
        assert!(d <= 1e-4, "{name}: chunk {chunk}: logits differ by {d:.2e}");
        for (layer, (a, b)) in s.iter().zip(&states).enumerate() {
            let (d, _) = max_abs_diff(a, b);
            let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(
                d <= 1e-5 * scale.max(1.0),
                "{name}: chunk {chunk}: state of recurrent layer {layer} differs by {d:.2e} (max |state| {scale:.2})"
            );
        }
    }
}

/// The chunked scans equal the one-shot scan: the state (and the logits) after a prompt
/// prefilled in chunks of 1, 3 or 16 match one pass, for every recurrent layer kind (Mamba-1,
/// Mamba-2 with one and two groups, Jamba's Mamba layers, the gated DeltaNet of Qwen3-Next
/// and Qwen3.5, RWKV-7's token shifts and state).
#[test]
fn chunked_prefill_leaves_the_same_state_as_one_pass() {
    for name in [
        "mamba",
        "falcon_mamba",
        "mamba2",
        "jamba",
        "bamba",
        "qwen3_next",
        "nemotron_h",
        "recurrent_gemma",
        "falcon_h1",
    ] {
        chunked_equals_one_pass(name, &reference(name).prompt_ids, &[1, 3, 16]);
    }
}

/// A prompt longer than one chunk of the delta rule (64 positions) runs the chunk-to-chunk
/// recurrence inside one call; it must agree with the one-token recurrence (chunks of 1) and
/// with calls whose lengths cut the internal chunks elsewhere (50, 16).
#[test]
fn the_delta_rule_carries_its_state_across_internal_chunks() {
    let ids = reference("qwen3_next").prompt_ids;
    let prompt: Vec<u32> = ids
        .iter()
        .chain(ids.iter().rev())
        .chain(&ids)
        .chain(ids.iter().rev())
        .copied()
        .collect();
    // Three internal chunks, the last one padded.
    assert!(prompt.len() > 2 * 64 && prompt.len() % 64 != 0);
    chunked_equals_one_pass("qwen3_next", &prompt, &[1, 16, 50]);
}

/// A state-space config or checkpoint that cannot work is refused naming the key or tensor.
#[test]
fn bad_state_space_checkpoints_are_refused_by_name() {
    let edit = |name: &str, key: &str, value: serde_json::Value| -> String {
        let dir = mlxcel_tests::copy_fixture(name);
        edit_config(dir.path(), |config| config[key] = value);
        let options = LoadOptions {
            skip_tokenizer: true,
            ..Default::default()
        };
        load_model(dir.path(), &options)
            .expect_err("loaded")
            .to_string()
    };
    // 8 heads cannot be split into 3 groups of B/C.
    let err = edit("mamba2", "n_groups", 3.into());
    assert!(err.contains("n_groups 3"), "{err}");
    // A state size the tensors do not have: the first tensor of that shape is named.
    let err = edit("mamba", "state_size", 8.into());
    assert!(err.contains("mixer.A_log` has shape [128, 16]"), "{err}");
    let err = edit("mamba", "time_step_rank", "big".into());
    assert!(err.contains("time_step_rank = \"big\""), "{err}");
    let err = edit("jamba", "mamba_d_conv", 0.into());
    assert!(err.contains("mamba_d_conv = 0"), "{err}");
    // Value heads that do not group evenly over the key heads, and a layer kind Qwen3-Next
    // does not have.
    let err = edit("qwen3_next", "linear_num_value_heads", 3.into());
    assert!(
        err.contains("linear_num_value_heads 3 must be a multiple of linear_num_key_heads 2"),
        "{err}"
    );
    let err = edit(
        "qwen3_next",
        "layer_types",
        serde_json::json!(["linear_attention", "sliding_attention"]),
    );
    assert!(
        err.contains("layer_types entry `sliding_attention`"),
        "{err}"
    );
    // A convolution of another width than the checkpoint's.
    let err = edit("mamba2", "conv_kernel", 3.into());
    assert!(
        err.contains("conv1d.weight` has shape [160, 1, 4]"),
        "{err}"
    );
}

/// Qwen3.5 is published as a vision-language model: the text config under `text_config`, the
/// decoder under `model.language_model.*` next to a vision tower, transformers' fused expert
/// stacks (`experts.gate_up_proj` `[E, 2I, H]`, `experts.down_proj` `[E, H, I]`). The text
/// fixture rewritten that way loads to the same logits.
#[test]
fn qwen3_5_loads_from_its_vision_language_layout() {
    use safetensors::tensor::TensorView;
    let name = "qwen3_5_moe_text";
    let dir = mlxcel_tests::copy_fixture(name);
    edit_config(dir.path(), |config| {
        *config = serde_json::json!({
            "model_type": "qwen3_5_moe",
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "tie_word_embeddings": false,
            "text_config": config.take(),
            "vision_config": {"depth": 1, "hidden_size": 8},
        });
    });
    let weights_path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&weights_path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: std::collections::BTreeMap<String, (Vec<usize>, Vec<u8>)> = Default::default();
    for (n, view) in st.tensors() {
        tensors.insert(n, (view.shape().to_vec(), view.data().to_vec()));
    }
    let f32s = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let to_bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let mut out: std::collections::BTreeMap<String, (Vec<usize>, Vec<u8>)> = Default::default();
    for layer in 0..2 {
        let prefix = format!("model.layers.{layer}.mlp.experts");
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        let mut experts = 0;
        while let Some((_, gate)) = tensors.remove(&format!("{prefix}.{experts}.gate_proj.weight"))
        {
            let (_, up) = tensors
                .remove(&format!("{prefix}.{experts}.up_proj.weight"))
                .unwrap();
            let (_, d) = tensors
                .remove(&format!("{prefix}.{experts}.down_proj.weight"))
                .unwrap();
            gate_up.extend(f32s(&gate));
            gate_up.extend(f32s(&up));
            down.extend(f32s(&d));
            experts += 1;
        }
        assert_eq!(experts, 4);
        // [E, 2I, H] with I = 16, H = 32; [E, H, I].
        out.insert(
            format!("{prefix}.gate_up_proj"),
            (vec![4, 32, 32], to_bytes(&gate_up)),
        );
        out.insert(
            format!("{prefix}.down_proj"),
            (vec![4, 32, 16], to_bytes(&down)),
        );
    }
    for (n, t) in tensors {
        let n = match n.strip_prefix("model.") {
            Some(rest) => format!("model.language_model.{rest}"),
            None => n,
        };
        out.insert(n, t);
    }
    out.insert(
        "model.visual.patch_embed.proj.weight".into(),
        (vec![8, 3], to_bytes(&[0.5; 24])),
    );
    let views: Vec<(String, TensorView)> = out
        .iter()
        .map(|(n, (shape, data))| {
            let view = TensorView::new(safetensors::Dtype::F32, shape.clone(), data).unwrap();
            (n.clone(), view)
        })
        .collect();
    std::fs::write(&weights_path, safetensors::serialize(views, &None).unwrap()).unwrap();
    let wrapped = load_without_tokenizer(dir.path());
    let r = reference(name);
    let got = mlxcel_tests::logits_for(&wrapped.model, &r.prompt_ids);
    let want = mlxcel_tests::logits_for(&load(name).model, &r.prompt_ids);
    let (d, _) = max_abs_diff(&got, &want);
    assert!(
        d <= 1e-6,
        "the vision-language layout changes the logits by {d:.2e}"
    );
}

/// RWKV-7 in mlx-lm's layout (`k_k`, `k_a`, `g_norm.*` as `[heads, head_dim]`, the fixture being
/// fla-hub's flat one) loads to the same logits; a mixing vector of the wrong size is refused by
/// name.
#[test]
fn rwkv7_loads_from_mlx_lm_layout_and_refuses_bad_shapes() {
    use safetensors::tensor::TensorView;
    let rewrite = |reshape: &dyn Fn(&str, &[usize]) -> Vec<usize>| -> tempfile::TempDir {
        let dir = mlxcel_tests::copy_fixture("rwkv7");
        let path = dir.path().join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| {
                let shape = reshape(&n, v.shape());
                (n, shape, v.data().to_vec())
            })
            .collect();
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .map(|(n, shape, data)| {
                // A shape with fewer elements keeps the leading values.
                let len = 4 * shape.iter().product::<usize>();
                let view = TensorView::new(safetensors::Dtype::F32, shape.clone(), &data[..len]);
                (n.clone(), view.unwrap())
            })
            .collect();
        std::fs::write(&path, safetensors::serialize(views, &None).unwrap()).unwrap();
        dir
    };
    let per_head = |n: &str, shape: &[usize]| -> Vec<usize> {
        let leaf = n.rsplit('.').next().unwrap();
        if leaf == "k_k" || leaf == "k_a" || n.contains(".attn.g_norm.") {
            vec![4, 8]
        } else {
            shape.to_vec()
        }
    };
    let dir = rewrite(&per_head);
    let mlx_layout = load_without_tokenizer(dir.path());
    let r = reference("rwkv7");
    let got = mlxcel_tests::logits_for(&mlx_layout.model, &r.prompt_ids);
    let want = mlxcel_tests::logits_for(&load("rwkv7").model, &r.prompt_ids);
    let (d, _) = max_abs_diff(&got, &want);
    assert!(d == 0.0, "mlx-lm's layout changes the logits by {d:.2e}");
    // A tensor of another size than its config implies is refused, naming it.
    let dir = rewrite(&|n: &str, shape: &[usize]| {
        if n == "model.layers.1.attn.x_v" {
            vec![1, 1, 16]
        } else {
            shape.to_vec()
        }
    });
    let options = LoadOptions {
        skip_tokenizer: true,
        ..Default::default()
    };
    let err = load_model(dir.path(), &options)
        .expect_err("loaded")
        .to_string();
    assert!(err.contains("model.layers.1.attn.x_v"), "{err}");
}
