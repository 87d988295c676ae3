"""The single-card loss from the ranks' losses weighted by pcp.loss_weight."""
import paddle.distributed as dist


def single_card_loss(weighted, mesh):
    """Collective: the one-card mean loss, as the mean over `sep` of the ranks' weighted losses
    (the workers' meshes are `sep` only)."""
    total = weighted.detach().clone()
    dist.all_reduce(total)
    return float(total) / mesh.shape[mesh.dim_names.index("sep")]
