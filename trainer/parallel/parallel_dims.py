"""Parallel degrees, their validation, and every named device mesh of a run.

API (the only way other code gets process groups):

    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, ep=2, ep_as_cp=False, world_size=4)
    # ^ validates only (no process-group work): raises ParallelDimsError naming the product
    #   that is wrong and a layout that would fit. dp_shard=-1 is inferred.
    dims.build_meshes("cuda")           # once per process, after init_process_group
    dims.mesh("fsdp")                   # a DeviceMesh by name (1-D unless noted)
    dims.has_mesh("ep")                 # whether that mesh is meaningful (degree > 1)
    dims.dp_enabled, dims.fsdp_enabled, dims.ep_enabled, dims.cp_enabled, dims.tp_enabled, ...
    dims.dp_degree, dims.loss_degree, dims.efsdp, dims.context_degree

Rank layout. The world is the row-major grid ``[dp_replicate, dp_shard, cp, tp]`` (tp fastest,
so TP stays inside a node). Expert parallelism borrows ranks from the ``dp_shard x cp`` block:
that block (flattened, cp fastest) is re-read as ``[efsdp, ep]`` with ep fastest, i.e. the
expert grid is ``[dp_replicate, efsdp, ep, tp]`` over the same ranks. So with ep == cp the
ep group is exactly the cp group, and with cp == 1 the ep group is ``ep`` consecutive
dp_shard ranks.

Mesh names (``mesh(name)``):
    "world"         the root grid [dp_replicate, dp_shard, cp, tp] (4-D)
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


class ParallelDimsError(ValueError):
    """A layout whose degrees do not fit the world size (raised before any process-group work)."""


# Meshes built for every multi-process layout (the engram ones are named by the config).
_MESH_NAMES = (
    "world", "dp_replicate", "dp_shard", "cp", "tp", "fsdp", "hsdp", "dp", "loss", "ep", "efsdp", "ehsdp",
    "sparse", "context",
)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    ep_as_cp: bool
    world_size: int
    engram: int = 1
    engram_mesh_name: str = "engram"
    _meshes: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    # ----------------------------------------------------------------- validation
    def _validate(self) -> None:
        w = self.world_size
        if w < 1:
            raise ParallelDimsError(f"world_size must be >= 1, got {w}")
        for name in ("dp_replicate", "cp", "tp", "ep"):
            if getattr(self, name) < 1:
                raise ParallelDimsError(f"parallelism.{name} must be >= 1, got {getattr(self, name)}")
        if self.dp_shard != -1 and self.dp_shard < 1:
            raise ParallelDimsError(f"parallelism.dp_shard must be >= 1 or -1 (infer), got {self.dp_shard}")
        if self.ep_as_cp:
            if self.cp != 1:
                raise ParallelDimsError(
                    f"parallelism.ep_as_cp uses the expert dim as the context dim, so parallelism.cp "
                    f"must be 1 (got cp={self.cp}); set --parallelism.cp 1 and shard the sequence "
                    f"with --parallelism.ep {self.ep * self.cp}"
                )
            if self.ep < 2:
                raise ParallelDimsError(f"parallelism.ep_as_cp needs parallelism.ep > 1, got ep={self.ep}")
        others = self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            if w % others:
                raise ParallelDimsError(
                    f"cannot infer dp_shard: dp_replicate x cp x tp = {self.dp_replicate} x {self.cp} x "
                    f"{self.tp} = {others} does not divide the world size {w}; pick degrees whose product "
                    f"divides {w} (divisors: {_divisors(w)})"
                )
            self.dp_shard = w // others
        product = others * self.dp_shard
        if product != w:
            fit = f"dp_shard = {w // others}" if w % others == 0 else f"degrees whose product is {w}"
            raise ParallelDimsError(
                f"dp_replicate x dp_shard x cp x tp = {self.dp_replicate} x {self.dp_shard} x {self.cp} x "
                f"{self.tp} = {product} != world size {w}; use {fit} (or dp_shard = -1 to infer it)"
            )
        block = self.dp_shard * self.cp
        if self.ep > 1 and block % self.ep:
            raise ParallelDimsError(
                f"parallelism.ep = {self.ep} must divide dp_shard x cp = {self.dp_shard} x {self.cp} = {block} "
                f"(expert parallelism borrows those ranks); pick ep in {_divisors(block)}"
            )
        self._validate_engram()

    def _validate_engram(self) -> None:
        """The Engram table is split over ranks that see different tokens (dp_replicate x
        dp_shard x cp); the degree must divide their number. -1 = all of them."""
        tokens = self.loss_degree
        if self.engram == -1:
            self.engram = tokens
        where = (
            f"the ranks that see different tokens: dp_replicate x dp_shard x cp = {self.dp_replicate} x "
            f"{self.dp_shard} x {self.cp} = {tokens} (tensor-parallel ranks share tokens)"
        )
        if self.engram < 1 or tokens % self.engram:
            raise ParallelDimsError(
                f"engram.embedding_parallel_degree = {self.engram} must divide {where}; pick one of "
                f"{_divisors(tokens)}, or -1 for all {tokens}"
            )
        if self.engram > 1 and self.engram_mesh_name in _MESH_NAMES:
            raise ParallelDimsError(
                f"engram.mesh_name = {self.engram_mesh_name!r} is already a mesh of the layout; "
                "pick another name (default 'engram')"
            )

    # ----------------------------------------------------------------- degrees
    @property
    def efsdp(self) -> int:
        """Expert FSDP degree: dp_shard x cp / ep."""
        return self.dp_shard * self.cp // self.ep

    @property
    def fsdp_degree(self) -> int:
        return self.dp_shard * self.cp

    @property
    def dp_degree(self) -> int:
        """Ranks that read different samples (the data loader's world size)."""
        if self.ep_as_cp:
            return self.dp_replicate * self.efsdp
        return self.dp_replicate * self.dp_shard

    @property
    def loss_degree(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def context_degree(self) -> int:
        """How many ranks split one sample's sequence."""
        return self.ep if self.ep_as_cp else self.cp

    @property
    def context_mesh_name(self) -> str:
        return "ep" if self.ep_as_cp else "cp"

    @property
    def engram_enabled(self) -> bool:
        """Engram tables are row-sharded (over the ``engram_mesh_name`` mesh)."""
        return self.engram > 1

    @property
    def engram_replicate_mesh_name(self) -> str:
        return self.engram_mesh_name + "_replicate"

    @property
    def dp_enabled(self) -> bool:
        return self.dp_degree > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards parameters whenever dp_shard x cp > 1 (cp ranks share the weights)."""
        return self.fsdp_degree > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.fsdp_enabled

    @property
    def data_parallel_enabled(self) -> bool:
        """Any replication of weights (gradients must be reduced)."""
        return self.dp_replicate > 1 or self.fsdp_enabled

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def context_enabled(self) -> bool:
        return self.context_degree > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def loss_enabled(self) -> bool:
        return self.loss_degree > 1

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
            (self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"),
        )
        m = self._meshes
        m["world"] = world
        for name in ("dp_replicate", "dp_shard", "cp", "tp"):
            m[name] = world[name]
        m["fsdp"] = world["dp_shard", "cp"]._flatten("fsdp")
        m["loss"] = world["dp_replicate", "dp_shard", "cp"]._flatten("loss")
        # HSDP's 2-D [dp_replicate, fsdp] mesh from a second root grid over the same ranks:
        # slicing a flattened dim together with a root dim is deprecated from torch 2.11.
        dense = DeviceMesh(
            device_type,
            world.mesh.reshape(self.dp_replicate, self.fsdp_degree, self.tp),
            mesh_dim_names=("dp_replicate", "fsdp", "tp"),
        )
        m["hsdp"] = dense["dp_replicate", "fsdp"]
        if not self.ep_as_cp:
            m["dp"] = world["dp_replicate", "dp_shard"]._flatten("dp")

        # The same ranks read as the expert grid [dp_replicate, efsdp, ep, tp] (a second root
        # mesh: its groups are distinct from the world mesh's).
        sparse = DeviceMesh(
            device_type,
            world.mesh.reshape(self.dp_replicate, self.efsdp, self.ep, self.tp),
            mesh_dim_names=("dp_replicate", "efsdp", "ep", "tp"),
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
                world.mesh.reshape(self.loss_degree // self.engram, self.engram, self.tp),
                mesh_dim_names=(rep, name, "tp"),
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

    def describe(self) -> str:
        parts = [f"{k} {getattr(self, k)}" for k in ("dp_replicate", "dp_shard", "cp", "tp", "ep")]
        if self.ep_as_cp:
            parts.append("ep_as_cp")
        return f"world size {self.world_size} = " + " x ".join(parts[:4]) + " | " + ", ".join(parts[4:]) + (
            f" | data-parallel {self.dp_degree}, fsdp {self.fsdp_degree}, efsdp {self.efsdp}"
        ) + (f", engram {self.engram}" if self.engram_enabled else "")

    @classmethod
    def from_config(cls, parallelism, world_size: int, engram=None) -> ParallelDims:
        """From the ``[parallelism]`` section (and ``[engram]``, when enabled, for its table split)."""
        p = parallelism
        use_engram = engram is not None and engram.enable
        return cls(
            dp_replicate=p.dp_replicate,
            dp_shard=p.dp_shard,
            cp=p.cp,
            tp=p.tp,
            ep=p.ep,
            ep_as_cp=p.ep_as_cp,
            world_size=world_size,
            engram=engram.embedding_parallel_degree if use_engram else 1,
            engram_mesh_name=engram.mesh_name if use_engram else "engram",
        )
