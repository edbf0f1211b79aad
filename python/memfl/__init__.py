"""memfl's Python client for `memfl server` (gRPC, the C++ client's protocol).

    import memfl
    client = memfl.Client("127.0.0.1:50051", client_id="0")
    for rnd in client.rounds():
        client.receive(model.state_dict())      # the global model, into your tensors
        n, loss = train(model)                  # your loop
        client.send(model.state_dict(), num_samples=n, metrics={"train_loss": loss})
"""
from ._memfl import Client as _Client

__all__ = ["Client"]


class Client(_Client):
    def rounds(self):
        """Yields each round's number until the server says the run is over."""
        while True:
            r = self.next_round()
            if r < 0:
                self.close()
                return
            yield r
