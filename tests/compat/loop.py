"""The training loop the client tests share: steps of one fixed batch through a client's own backward."""
import torch


def train_steps(model, backward, opt, x, y, steps: int) -> list:
    """`steps` optimizer steps of MSE(model(x), y), the loss passed to `backward` (the client's:
    Accelerator.backward, Fabric.backward); returns the losses."""
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
