//! MLX's distributed layer (`mlx::core::distributed`): a [`Group`] of processes and the
//! collectives over it ([`Group::all_sum`], [`Group::all_gather`], [`Group::send`],
//! [`Group::recv`], ...). MLX picks the transport: NCCL between CUDA devices, a TCP ring (CPU
//! and Apple machines), MPI or RDMA; each needs its own environment, which `mlxcel launch`
//! sets (the ring backend reads `MLX_RANK` and `MLX_HOSTFILE`, a JSON list with one list of
//! `"ip:port"` addresses per rank; NCCL reads `MLX_RANK`, `MLX_WORLD_SIZE`, `NCCL_HOST_IP` and
//! `NCCL_PORT`).
//!
//! Collectives are lazy like every other op: they run when their result is evaluated. A peer
//! that is gone makes the evaluation fail (an [`Error::Mlx`]), never abort.

use cxx::UniquePtr;

use crate::array::ArrayList;
use crate::ffi::bridge::{self, DistGroup};
use crate::{Array, Dtype, Error, Result};

/// Which of MLX's transports [`init`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Backend {
    /// The first available one, in MLX's order.
    #[default]
    Any,
    /// TCP ring (CPU; loopback for several processes on one machine).
    Ring,
    /// NVIDIA's NCCL between CUDA devices.
    Nccl,
    /// MPI (`mpirun`).
    Mpi,
    /// RDMA over Thunderbolt (Apple).
    Jaccl,
}

impl Backend {
    /// MLX's name of the backend (`any`, `ring`, `nccl`, `mpi`, `jaccl`).
    pub fn name(self) -> &'static str {
        match self {
            Backend::Any => "any",
            Backend::Ring => "ring",
            Backend::Nccl => "nccl",
            Backend::Mpi => "mpi",
            Backend::Jaccl => "jaccl",
        }
    }

    /// The backend named `name` (as [`Backend::name`] writes it).
    pub fn parse(name: &str) -> Result<Backend> {
        Ok(match name {
            "any" => Backend::Any,
            "ring" => Backend::Ring,
            "nccl" => Backend::Nccl,
            "mpi" => Backend::Mpi,
            "jaccl" => Backend::Jaccl,
            other => {
                return Err(Error::Invalid(format!(
                    "unknown distributed backend `{other}` (expected any, ring, nccl, mpi or jaccl)"
                )))
            }
        })
    }
}

/// Whether `backend` is compiled into this `libmlx` (and, for `Any`, whether any is).
pub fn is_available(backend: Backend) -> Result<bool> {
    Ok(bridge::distributed_is_available(backend.name())?)
}

/// Joins the group of every process started for this job through `backend` (reading the
/// backend's environment). `strict`: an error when no backend can be initialised; otherwise
/// such a process gets a group of one, where every collective is the identity.
pub fn init(backend: Backend, strict: bool) -> Result<Group> {
    Ok(Group {
        raw: bridge::distributed_init(strict, backend.name())?,
    })
}

/// A group of processes collectives run over (`mlx::core::distributed::Group`). Cheap to
/// clone (a shared handle).
pub struct Group {
    raw: UniquePtr<DistGroup>,
}

impl Clone for Group {
    fn clone(&self) -> Group {
        // MLX's Group is a shared pointer: the copy is the same group.
        Group { raw: self.share() }
    }
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .finish()
    }
}

impl Group {
    fn share(&self) -> UniquePtr<DistGroup> {
        bridge::group_clone(&self.raw).expect("copying a distributed group handle")
    }

    /// This process's rank in the group, `0..size`.
    pub fn rank(&self) -> usize {
        bridge::group_rank(&self.raw).map_or(0, |r| r as usize)
    }

    /// The number of processes in the group.
    pub fn size(&self) -> usize {
        bridge::group_size(&self.raw).map_or(1, |s| s as usize)
    }

    /// The sub-group of the processes that pass the same `color`, ranked by `key` (by their
    /// rank here when `key` is `None`).
    pub fn split(&self, color: i32, key: Option<i32>) -> Result<Group> {
        Ok(Group {
            raw: bridge::group_split(&self.raw, color, key.unwrap_or(-1))?,
        })
    }

    /// The element-wise sum of `x` over every process (same shape on each).
    pub fn all_sum(&self, x: &Array) -> Result<Array> {
        Ok(Array::from_raw(bridge::dist_all_sum(
            x.as_ref(),
            &self.raw,
        )?))
    }

    /// The element-wise maximum of `x` over every process.
    pub fn all_max(&self, x: &Array) -> Result<Array> {
        Ok(Array::from_raw(bridge::dist_all_max(
            x.as_ref(),
            &self.raw,
        )?))
    }

    /// Every process's `x` concatenated along the first axis, in rank order.
    pub fn all_gather(&self, x: &Array) -> Result<Array> {
        Ok(Array::from_raw(bridge::dist_all_gather(
            x.as_ref(),
            &self.raw,
        )?))
    }

    /// Sends `x` to rank `dst` when the returned array is evaluated (it equals `x`).
    pub fn send(&self, x: &Array, dst: usize) -> Result<Array> {
        Ok(Array::from_raw(bridge::dist_send(
            x.as_ref(),
            dst as i32,
            &self.raw,
        )?))
    }

    /// An array of `shape` and `dtype` received from rank `src` when evaluated.
    pub fn recv(&self, shape: &[i32], dtype: Dtype, src: usize) -> Result<Array> {
        crate::array::check_shape(shape)?;
        Ok(Array::from_raw(bridge::dist_recv(
            shape, dtype, src as i32, &self.raw,
        )?))
    }
}

/// `inputs`, unchanged, but computed only after `dependencies` (`mlx::core::depends`): ties a
/// side effect such as [`Group::send`] to a result that is evaluated.
pub fn depends(inputs: &[Array], dependencies: &[Array]) -> Result<Vec<Array>> {
    let (i, d) = (ArrayList::new(inputs)?, ArrayList::new(dependencies)?);
    ArrayList::from_raw(bridge::depends(i.as_ref(), d.as_ref())?).into_vec()
}
