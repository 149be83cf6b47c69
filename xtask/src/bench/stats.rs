//! Measurements of one run, their medians and ratios, and the table they make.

use serde_json::Value;

/// What one fresh process reported (the JSON line `mlxcel generate --stats-json` and
/// `xtask/bench/mlx_lm_bench.py` print on stderr), plus the child's peak RSS from `wait4`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sample {
    pub load_s: f64,
    pub prefill_tps: f64,
    pub decode_tps: f64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    /// The process's own VmHWM (bytes); `wait4`'s `ru_maxrss` when it reports none.
    pub peak_rss_bytes: u64,
    pub device: String,
    pub dtype: String,
}

/// The last stderr line that is a JSON object with the stats keys.
pub fn parse_stats(stderr: &str) -> Option<Sample> {
    stderr.lines().rev().find_map(|line| {
        let line = line.trim();
        if !line.starts_with('{') {
            return None;
        }
        let v: Value = serde_json::from_str(line).ok()?;
        let f = |k: &str| v.get(k).and_then(Value::as_f64);
        let u = |k: &str| v.get(k).and_then(Value::as_u64);
        let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
        Some(Sample {
            load_s: f("load_s")?,
            prefill_tps: f("prefill_tps")?,
            decode_tps: f("decode_tps")?,
            prompt_tokens: u("prompt_tokens")?,
            generated_tokens: u("generated_tokens")?,
            peak_rss_bytes: u("vmhwm_bytes").unwrap_or(0),
            device: s("device"),
            dtype: s("dtype"),
        })
    })
}

/// The median (mean of the middle two for an even count); `None` when empty or not finite.
pub fn median(values: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// `ours / theirs`, `None` when either is missing or `theirs` is not positive.
pub fn ratio(ours: Option<f64>, theirs: Option<f64>) -> Option<f64> {
    match (ours, theirs) {
        (Some(a), Some(b)) if b > 0.0 && a.is_finite() => Some(a / b),
        _ => None,
    }
}

/// Medians over the samples of one engine configuration.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Summary {
    pub runs: usize,
    pub load_s: Option<f64>,
    pub prefill_tps: Option<f64>,
    pub decode_tps: Option<f64>,
    pub peak_rss_mib: Option<f64>,
}

pub fn summarize(samples: &[Sample]) -> Summary {
    let pick = |f: fn(&Sample) -> f64| median(&samples.iter().map(f).collect::<Vec<_>>());
    Summary {
        runs: samples.len(),
        load_s: pick(|s| s.load_s),
        prefill_tps: pick(|s| s.prefill_tps),
        decode_tps: pick(|s| s.decode_tps),
        peak_rss_mib: pick(|s| s.peak_rss_bytes as f64 / (1u64 << 20) as f64),
    }
}

/// A number for the table: `-` when missing.
pub fn fmt(v: Option<f64>, decimals: usize) -> String {
    match v {
        Some(x) => format!("{x:.decimals$}"),
        None => "-".to_string(),
    }
}

/// A ratio for the table (`1.23×`), `-` when missing.
pub fn fmt_ratio(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_string(), |x| format!("{x:.2}×"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_last_stats_line_among_other_output() {
        let stderr = "[loaded x in 0.1s]\n{\"not\": \"stats\"}\n\
            {\"engine\":\"mlxcel\",\"dtype\":\"float32\",\"device\":\"Cpu\",\"load_s\":0.5,\
            \"prompt_tokens\":128,\"prefill_s\":2.0,\"prefill_tps\":64.0,\"generated_tokens\":32,\
            \"decode_s\":3.1,\"decode_tps\":10.0,\"peak_mlx_bytes\":1,\"vmhwm_bytes\":2097152}\n\
            trailing text\n";
        let s = parse_stats(stderr).unwrap();
        assert_eq!(s.load_s, 0.5);
        assert_eq!(s.prefill_tps, 64.0);
        assert_eq!(s.decode_tps, 10.0);
        assert_eq!((s.prompt_tokens, s.generated_tokens), (128, 32));
        assert_eq!(s.peak_rss_bytes, 2 << 20);
        assert_eq!(s.dtype, "float32");
        assert_eq!(parse_stats("no json here\n{broken"), None);
    }

    #[test]
    fn median_and_ratio() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[f64::NAN, 5.0]), Some(5.0));
        assert_eq!(ratio(Some(3.0), Some(2.0)), Some(1.5));
        assert_eq!(ratio(Some(3.0), Some(0.0)), None);
        assert_eq!(ratio(None, Some(2.0)), None);
        assert_eq!(fmt_ratio(Some(0.5)), "0.50×");
        assert_eq!(fmt(None, 1), "-");
    }

    #[test]
    fn summary_takes_medians_per_field() {
        let mk = |load_s, decode_tps| Sample {
            load_s,
            decode_tps,
            prefill_tps: 1.0,
            peak_rss_bytes: 1 << 20,
            ..Default::default()
        };
        let s = summarize(&[mk(1.0, 9.0), mk(3.0, 7.0), mk(2.0, 8.0)]);
        assert_eq!(s.runs, 3);
        assert_eq!(s.load_s, Some(2.0));
        assert_eq!(s.decode_tps, Some(8.0));
        assert_eq!(s.peak_rss_mib, Some(1.0));
    }
}
