"""LayerProgress: how far a request's KV is computed on the sender, for layer-wise streaming.

    model engine thread                           transfer worker
      layer 0 done -> final(0)                      wait(4): layers 0..3 final?  -> send group 0
      layer 1 done -> final(1)                      wait(8)                      -> send group 1
      ...                                           ...
      AUX row written, returned -> complete()       wait_complete()              -> AUX, TransferDone

A layer is final once its KV (and, for a linear layer, its state) is in the pool and will not
change. On a CUDA pool the engine's kernels may still be queued when it reports a layer, so
final() records an event on the reporting thread's stream and wait() synchronizes it before
it returns: the bytes a transport reads are the computed ones. wait() gives up with
Cancelled as soon as `stopped()` says the request ended.
"""

import threading

import numpy as np
import torch

from transfer.errors import Cancelled

POLL_S = 0.05  # how often a waiting worker asks whether its request was stopped


class LayerProgress:
    def __init__(self, num_layers: int, device: str | torch.device = "cpu"):
        self.num_layers = num_layers
        self._device = torch.device(device)
        self._cuda = self._device.type == "cuda"
        self._done = np.zeros(num_layers, dtype=bool)
        self._final = 0  # layers [0, _final) are final
        self._complete = False  # the engine returned: every layer and the AUX row written
        self._event = None  # CUDA: recorded at the latest report, on the engine's stream
        self._cond = threading.Condition()

    @property
    def final_layers(self) -> int:
        with self._cond:
            return self._final

    def final(self, layer: int) -> None:
        """Layer `layer` is in the pool (the engine's on_layer)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.num_layers})")
        event = self._record()
        with self._cond:
            self._done[layer] = True
            while self._final < self.num_layers and self._done[self._final]:
                self._final += 1
            self._event = event or self._event
            self._cond.notify_all()

    def complete(self) -> None:
        """The engine returned: everything, the AUX row included, is in the pool."""
        event = self._record()
        with self._cond:
            self._done[:] = True
            self._final, self._complete = self.num_layers, True
            self._event = event or self._event
            self._cond.notify_all()

    def wait(self, layers: int, stopped=lambda: False, idle=lambda: None) -> None:
        """Block until layers [0, layers) are final (and their kernels done). `idle()` runs
        every POLL_S meanwhile (the sender drives its writes in flight with it)."""
        self._wait(lambda: self._final >= layers, stopped, idle)

    def wait_complete(self, stopped=lambda: False, idle=lambda: None) -> None:
        self._wait(lambda: self._complete, stopped, idle)

    def _wait(self, ready, stopped, idle) -> None:
        while True:
            with self._cond:
                if not ready() and not stopped():
                    self._cond.wait(POLL_S)
                if ready():
                    event = self._event
                    break
            if stopped():
                raise Cancelled("send stopped while the KV was being computed: the request ended")
            idle()
        if event is not None:
            event.synchronize()

    def _record(self):
        if not self._cuda:
            return None
        event = torch.cuda.Event(blocking=True)  # the waiting worker sleeps: a spinning one contends with
        event.record(torch.cuda.current_stream(self._device))  # the engine thread for the driver
        return event
