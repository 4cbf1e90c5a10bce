"""Every named device mesh of a run, built on a validated `Layout` (trainer/config/layout.py,
where the degrees, their checks and the rank layout are defined).

API (the only way other code gets process groups):

    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, ep=2, ep_as_cp=False, world_size=4)
    # ^ validates only (no process-group work): raises ParallelDimsError naming the product
    #   that is wrong and a layout that would fit. dp_shard=-1 is inferred.
    dims.build_meshes("cuda")           # once per process, after init_process_group
    dims.mesh("fsdp")                   # a DeviceMesh by name (1-D unless noted)
    dims.has_mesh("ep")                 # whether that mesh is meaningful (degree > 1)
    dims.data_parallel_enabled, dims.fsdp_enabled, dims.ep_enabled, dims.cp_enabled, dims.tp_enabled, ...
    dims.dp_degree, dims.loss_degree, dims.efsdp, dims.context_degree

Rank layout. The world is the row-major grid ``[pp, dp_replicate, dp_shard, cp, tp]`` (tp fastest,
so TP stays inside a node; pp slowest, so stages talk across nodes). Every mesh below except
"world" and "pp" lives inside one pipeline stage's ranks: each stage has its own groups. Expert parallelism borrows ranks from the ``dp_shard x cp`` block:
that block (flattened, cp fastest) is re-read as ``[efsdp, ep]`` with ep fastest, i.e. the
expert grid is ``[dp_replicate, efsdp, ep, tp]`` over the same ranks. So with ep == cp the
ep group is exactly the cp group, and with cp == 1 the ep group is ``ep`` consecutive
dp_shard ranks.

Mesh names (``mesh(name)``):
    "world"         the root grid [pp, dp_replicate, dp_shard, cp, tp] (5-D)
    "pp"            pipeline parallel: the ranks holding the stages of one pipeline
    "dp_replicate"  HSDP replicate dim
    "dp_shard"      FSDP shard dim without cp
    "cp", "tp"      context / tensor parallel
    "fsdp"          dp_shard x cp flattened: what FSDP shards non-expert params over
    "hsdp"          [dp_replicate, fsdp] 2-D: FSDP's mesh for non-expert params when
                    dp_replicate > 1 (else use "fsdp")
    "dp"            every rank that reads different samples: the batch / data-loader shard.
                    dp_replicate x dp_shard, except with ep_as_cp, where the ep ranks split one
                    sample's sequence and dp is dp_replicate x efsdp
    "loss"          dp_replicate x dp_shard x cp: every rank holding different tokens, where
                    the loss, valid-token counts and router counts are summed
    "ep"            expert parallel (tokens all-to-all over it)
    "efsdp"         (dp_shard x cp) / ep: what FSDP shards expert params over
    "ehsdp"         [dp_replicate, efsdp] 2-D: expert FSDP mesh when dp_replicate > 1
    "context"       the mesh that shards the sequence: "ep" with ep_as_cp, else "cp"
    "engram"        Engram table rows are split over it (only when ``engram > 1``; the name is
                    ``engram_mesh_name``): ``engram`` consecutive ranks of the "loss" block, i.e.
                    ranks that see different tokens. TP ranks share tokens, so each TP index
                    has its own engram groups.
    "engram_replicate"  the ranks holding the same table shard (loss_degree / engram of them),
                    whose table gradients are summed

EP-as-CP (MaxText): ``ep_as_cp=True`` requires ``cp == 1`` in the config; the ep ranks then
shard the sequence outside the MoE (``context_degree == ep``) and the experts exchange tokens
over the same "ep" mesh. Only the context-parallel code reads ``context_mesh_name``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.config.layout import Layout, LayoutError

# The name callers catch.
ParallelDimsError = LayoutError


@dataclass
class ParallelDims(Layout):
    """A validated `Layout` (every degree check is there) that also builds the named meshes."""

    _meshes: dict = field(default_factory=dict, init=False, repr=False)

    # ----------------------------------------------------------------- meshes
    def build_meshes(self, device_type: str) -> None:
        """Builds every named mesh once. Needs an initialised default process group when
        world_size > 1; with world_size == 1 it builds nothing and ``mesh()`` raises."""
        if self._meshes:
            return
        if self.world_size == 1:
            return
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        world = init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"),
        )
        m = self._meshes
        m["world"] = world
        for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
            m[name] = world[name]
        m["fsdp"] = world["dp_shard", "cp"]._flatten("fsdp")
        m["loss"] = world["dp_replicate", "dp_shard", "cp"]._flatten("loss")
        # HSDP's 2-D [dp_replicate, fsdp] mesh from a second root grid over the same ranks:
        # slicing a flattened dim together with a root dim is deprecated from torch 2.11.
        dense = DeviceMesh(
            device_type,
            world.mesh.reshape(self.pp, self.dp_replicate, self.fsdp_degree, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"),
        )
        m["hsdp"] = dense["dp_replicate", "fsdp"]
        if not self.ep_as_cp:
            m["dp"] = world["dp_replicate", "dp_shard"]._flatten("dp")

        # The same ranks read as the expert grid [dp_replicate, efsdp, ep, tp] (a second root
        # mesh: its groups are distinct from the world mesh's).
        sparse = DeviceMesh(
            device_type,
            world.mesh.reshape(self.pp, self.dp_replicate, self.efsdp, self.ep, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep", "tp"),
        )
        m["sparse"] = sparse
        m["ep"] = sparse["ep"]
        m["efsdp"] = sparse["efsdp"]
        m["ehsdp"] = sparse["dp_replicate", "efsdp"]
        if self.ep_as_cp:
            m["dp"] = sparse["dp_replicate", "efsdp"]._flatten("dp")
        m["context"] = m[self.context_mesh_name]
        if self.engram_enabled:
            # The "loss" block re-read as [replicas, engram] (engram fastest: neighbouring ranks
            # exchange the lookups), a root mesh of its own like "sparse".
            name, rep = self.engram_mesh_name, self.engram_replicate_mesh_name
            grid = DeviceMesh(
                device_type,
                world.mesh.reshape(self.pp, self.loss_degree // self.engram, self.engram, self.tp),
                mesh_dim_names=("pp", rep, name, "tp"),
            )
            m[name], m[rep] = grid[name], grid[rep]

    def mesh(self, name: str):
        """The DeviceMesh called ``name`` (see the module docstring)."""
        if not self._meshes:
            raise RuntimeError(
                "ParallelDims.build_meshes() has not run (or world_size == 1, which has no meshes)"
            )
        try:
            return self._meshes[name]
        except KeyError:
            raise KeyError(f"no mesh named {name!r}; available: {sorted(self._meshes)}") from None

    def mesh_or_none(self, name: str):
        """The mesh, or None when meshes were not built (one process) or it has size 1."""
        return self._meshes[name] if self.has_mesh(name) else None

    def dp_rank_and_degree(self) -> tuple[int, int]:
        """This rank's index in the "dp" mesh and its size: what the data loader shards by."""
        if not self._meshes:
            return 0, 1
        dp = self._meshes["dp"]
        return dp.get_local_rank(), dp.size()

    def has_mesh(self, name: str) -> bool:
        """Built and of size > 1."""
        return name in self._meshes and self._meshes[name].size() > 1

    @property
    def meshes_built(self) -> bool:
        return bool(self._meshes)
