"""PaddleFormers Llama trained on one card as tensor_parallel.py's reference trains it."""
from tensor_parallel import WELL_CONDITIONED_EPSILON, batches, build


def trained(steps):
    """The model and optimizer after `steps` AdamW steps on the global batches."""
    model, optimizer = build("llama", WELL_CONDITIONED_EPSILON)
    for ids, labels in list(batches("llama"))[:steps]:
        model(input_ids=ids, labels=labels)[0].backward()
        optimizer.step()
        optimizer.clear_grad()
    return model, optimizer
