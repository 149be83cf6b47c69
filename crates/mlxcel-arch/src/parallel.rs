//! How a model is spread over the processes of an MLX distributed [`Group`].
//!
//! **Tensor parallelism** ([`TensorParallel`]): every rank holds every layer, but only its part
//! of each attention and feed-forward block (Megatron's split, as mlx-lm's `shard_linear` does
//! it): the query/key/value projections and the gate/up projections keep their rank's output
//! rows (heads, MLP columns: "all-to-sharded"), the output and down projections their input
//! columns ("sharded-to-all"), so a block's result on each rank is a partial sum that one
//! `all_sum` completes. Routed experts are split the same way (each expert's intermediate
//! columns), an untied output head by vocabulary rows (the logits gathered from every rank);
//! the router, norms and embedding are replicated. Multi-head latent attention splits its
//! heads (query rows, the per-head latent projections, output columns) and keeps the shared
//! latent projection whole. Linear-attention and state-space mixers are not split. Splits may be uneven (the
//! first ranks take one unit more); quantized layers split on whole quantization groups. Each
//! rank reads only its rows and columns from the mapped checkpoint
//! ([`mlxcel_core::WeightMap::get_slice`]).
//!
//! **Pipeline parallelism** ([`Pipeline`]): each rank holds a contiguous range of layers; the
//! hidden states go from rank to rank with `send`/`recv`, and the last rank's logits come back
//! to every rank (an `all_sum` of the logits with zeros elsewhere), so every rank samples the
//! same token and keeps its own layers' caches.

use std::ops::Range;

use mlxcel_core::distributed::Group;

use crate::{ModelError, Result};

/// How a model is spread over a group of processes (see the module docs).
#[derive(Debug, Clone)]
pub enum Parallelism {
    /// Heads, MLP columns and expert columns split over the group.
    Tensor(TensorParallel),
    /// Contiguous layer ranges per rank (each model picks its stage, [`PipelinePlan::stage`]).
    Pipeline(PipelinePlan),
}

/// `units` split over `parts` as evenly as possible: part `i`'s range (the first
/// `units % parts` parts take one more).
pub fn even_part(units: i32, parts: usize, i: usize) -> Range<i32> {
    let (parts, i) = (parts as i32, i as i32);
    let base = units / parts;
    let extra = units % parts;
    let start = i * base + i.min(extra);
    start..start + base + i32::from(i < extra)
}

/// This rank's part of a tensor-parallel model (see the module docs).
#[derive(Debug, Clone)]
pub struct TensorParallel {
    group: Group,
}

/// The attention heads one rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadSplit {
    /// Its query heads (a contiguous range of the model's).
    pub q: Range<i32>,
    /// The key/value head behind each of its key/value groups, in order (a head repeats when
    /// two ranks' query heads share it and the local groups would otherwise be unequal).
    pub kv: Vec<i32>,
}

impl HeadSplit {
    /// Rows `[start, end)` of a projection with `head_dim` rows per head for `heads`, merged
    /// where consecutive.
    pub fn rows(heads: &[i32], head_dim: i32) -> Vec<Range<i32>> {
        let mut out: Vec<Range<i32>> = Vec::new();
        for &h in heads {
            let r = h * head_dim..(h + 1) * head_dim;
            match out.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => out.push(r),
            }
        }
        out
    }
}

impl TensorParallel {
    /// Tensor parallelism over `group` (every rank of it).
    pub fn new(group: Group) -> TensorParallel {
        TensorParallel { group }
    }

    /// The group the partial sums are reduced over.
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// This rank's part of `width` columns split in whole units of `unit` (a quantization
    /// group, or 1); `what` names the dimension in the error when there are fewer units than
    /// ranks.
    pub fn columns(&self, width: i32, unit: i32, what: &str) -> Result<Range<i32>> {
        let unit = unit.max(1);
        if width % unit != 0 || width / unit < self.size() as i32 {
            return Err(ModelError::Unsupported(format!(
                "tensor parallelism over {} ranks: {what} ({width} columns in units of {unit}) cannot be split that many ways",
                self.size()
            )));
        }
        let r = even_part(width / unit, self.size(), self.rank());
        Ok(r.start * unit..r.end * unit)
    }

    /// This rank's heads of an attention layer with `heads` query heads in `kv_heads` groups:
    /// whole key/value groups when there are at least as many as ranks, else a run of query
    /// heads with the key/value heads they read (repeated where needed). An error when there
    /// are fewer query heads than ranks.
    pub fn heads(&self, heads: i32, kv_heads: i32) -> Result<HeadSplit> {
        let (size, rank) = (self.size(), self.rank());
        if kv_heads <= 0 || heads % kv_heads != 0 {
            return Err(ModelError::Config(format!(
                "{heads} attention heads in {kv_heads} key/value groups"
            )));
        }
        let rep = heads / kv_heads;
        if kv_heads as usize >= size {
            let kv = even_part(kv_heads, size, rank);
            return Ok(HeadSplit {
                q: kv.start * rep..kv.end * rep,
                kv: kv.collect(),
            });
        }
        if (heads as usize) < size {
            return Err(ModelError::Unsupported(format!(
                "tensor parallelism over {size} ranks: only {heads} attention heads ({kv_heads} key/value heads); use at most {heads} ranks or pipeline parallelism"
            )));
        }
        let q = even_part(heads, size, rank);
        let of_q: Vec<i32> = q.clone().map(|h| h / rep).collect();
        let mut distinct = of_q.clone();
        distinct.dedup();
        let per_group = |k: &i32| of_q.iter().filter(|x| *x == k).count();
        let uniform = distinct
            .iter()
            .all(|k| per_group(k) == per_group(&distinct[0]));
        Ok(HeadSplit {
            q,
            kv: if uniform { distinct } else { of_q },
        })
    }
}

/// The layers rank `rank` of `size` holds in a model of `total` layers: `counts[rank]` after
/// the earlier ranks' counts when given (layers sized to each rank's memory), else an even
/// split (the first ranks take one more). An error when there are more ranks than layers or the
/// counts do not add up to the model's layers.
pub fn stage_layers(
    total: usize,
    size: usize,
    rank: usize,
    counts: Option<&[usize]>,
) -> Result<Range<usize>> {
    if size > total {
        return Err(ModelError::Unsupported(format!(
            "pipeline parallelism over {size} ranks: the model has only {total} layers"
        )));
    }
    match counts {
        None => {
            let r = even_part(total as i32, size, rank);
            Ok(r.start as usize..r.end as usize)
        }
        Some(c) => {
            if c.len() != size || c.iter().sum::<usize>() != total || c.contains(&0) {
                return Err(ModelError::Config(format!(
                    "pipeline layers per rank {c:?}: {size} positive counts adding up to the model's {total} layers expected"
                )));
            }
            let start: usize = c[..rank].iter().sum();
            Ok(start..start + c[rank])
        }
    }
}

/// A pipeline-parallel job: the group, and optionally each rank's number of layers.
#[derive(Debug, Clone)]
pub struct PipelinePlan {
    /// The ranks, in pipeline order.
    pub group: Group,
    /// Layers per rank, in rank order (`None`: as even as possible).
    pub layers_per_rank: Option<Vec<usize>>,
}

impl PipelinePlan {
    /// This rank's stage of a model of `total` layers.
    pub fn stage(&self, total: usize) -> Result<Pipeline> {
        let layers = stage_layers(
            total,
            self.group.size(),
            self.group.rank(),
            self.layers_per_rank.as_deref(),
        )?;
        Ok(Pipeline {
            group: self.group.clone(),
            layers,
            total,
        })
    }
}

/// This rank's stage of a pipeline-parallel model (see the module docs).
#[derive(Debug, Clone)]
pub struct Pipeline {
    group: Group,
    layers: Range<usize>,
    total: usize,
}

impl Pipeline {
    /// The group the stages talk over.
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// This rank's layers.
    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// Whether this rank embeds the tokens (the first stage).
    pub fn is_first(&self) -> bool {
        self.group.rank() == 0
    }

    /// Whether this rank computes the logits (the last stage).
    pub fn is_last(&self) -> bool {
        self.group.rank() + 1 == self.group.size()
    }

    /// The model's number of layers.
    pub fn total_layers(&self) -> usize {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_parts_cover_the_units_in_order() {
        for units in 1..12 {
            for parts in 1..=units as usize {
                let ranges: Vec<_> = (0..parts).map(|i| even_part(units, parts, i)).collect();
                assert_eq!(ranges[0].start, 0);
                assert_eq!(ranges[parts - 1].end, units);
                for w in ranges.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert!(w[0].len() >= w[1].len() && w[0].len() <= w[1].len() + 1);
                }
            }
        }
    }

    #[test]
    fn head_rows_merge_consecutive_heads() {
        assert_eq!(
            HeadSplit::rows(&[0, 1], 4),
            std::iter::once(0..8).collect::<Vec<_>>()
        );
        assert_eq!(HeadSplit::rows(&[1, 1], 4), vec![4..8, 4..8]);
    }
}
