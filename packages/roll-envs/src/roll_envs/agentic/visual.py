"""VisualFrozenLake (`env=visual_frozen_lake`): FrozenLake seen as a picture, for vision-language policies.

The game is `FrozenLakeEnv`'s (seeded solvable maps, moves, slipperiness, rewards, step limit, expert): only the
observation differs. Every observation is `{"text": str, "images": [one RGB picture of the lake]}`: the text says
what the last move did (or why it was invalid) and never spells the map, so the map reaches the model only through
the picture, which stands where the text's one `<image>` marker is (an `<image>` quoted from the model's reply is
defused). The picture is a `size * cell_px` square: one `cell_px` square per cell (ice light blue, holes dark blue,
goal gold, start pale grey), the player a red square inset in its cell, 1-pixel grey grid lines. With the default
`cell_px=28`, one cell is one 2x2 block of 14-pixel patches: one picture token per cell for the Qwen-VL families (a
4x4 lake is 16 tokens).

Rendering is deterministic: the same state gives the same pixels (and `roll_core.multimodal.digest`), different
states different ones. `info["state"]` is FrozenLake's text key of the state (GiGPO groups by it). Needs Pillow
(`pip install roll-core[vision]`); the import happens on the first rendering, so listing environments stays cheap.
"""

from __future__ import annotations

from typing import Any, ClassVar

from roll_envs.agentic.frozen_lake import FrozenLakeEnv

#: RGB colours of the picture.
COLOURS: dict[str, tuple[int, int, int]] = {
    "F": (190, 225, 250),  # frozen ice
    "S": (215, 215, 215),  # start
    "H": (20, 40, 110),  # hole
    "G": (245, 190, 30),  # goal
    "P": (220, 30, 30),  # player
    "grid": (128, 128, 128),
}
LEGEND = "In the picture you are red, holes are dark blue, the goal is gold, safe ice is light blue."
#: roll_core.multimodal.IMAGE_MARKER (not imported: these modules stay free of torch).
IMAGE_MARKER = "<image>"
#: Where the picture goes while the observation text is built (replaced by the marker at the end).
_SLOT = "\x00picture\x00"


class VisualFrozenLakeEnv(FrozenLakeEnv):
    """FrozenLake whose observations are pictures (see the module docstring)."""

    name: ClassVar[str] = "visual_frozen_lake"

    def __init__(self, size: int = 4, cell_px: int = 28, **kwargs: Any) -> None:
        super().__init__(size=size, **kwargs)
        if not 4 <= int(cell_px) <= 128:
            raise ValueError(f"cell_px must be in [4, 128], got {cell_px}")
        self.cell_px = int(cell_px)

    # The text part: short, without the map (the picture carries it, where the `<image>` marker stands).
    def _render(self) -> str:
        return f"The lake: {_SLOT}"

    def _rules(self) -> str:
        return f"{super()._rules()} You see the lake as a picture. {LEGEND}"

    def picture(self) -> Any:  # -> PIL.Image.Image
        """The current state as an RGB picture (`size * cell_px` pixels square)."""
        from roll_core.multimodal.images import PILLOW

        PILLOW.require()
        from PIL import Image, ImageDraw

        c, n = self.cell_px, self.size
        img = Image.new("RGB", (n * c, n * c), COLOURS["F"])
        draw = ImageDraw.Draw(img)
        for r in range(n):
            for col in range(n):
                p = (r, col)
                kind = "H" if p in self.holes else "G" if p == self.goal else "S" if p == (0, 0) else "F"
                box = (col * c, r * c, (col + 1) * c - 1, (r + 1) * c - 1)
                draw.rectangle(box, fill=COLOURS[kind], outline=COLOURS["grid"])
                if p == self.player:
                    inset = max(1, c // 5)
                    draw.rectangle((box[0] + inset, box[1] + inset, box[2] - inset, box[3] - inset), fill=COLOURS["P"])
        return img

    def _with_picture(self, text: str) -> dict[str, Any]:
        # Invalid-action messages quote the model's reply: an `<image>` it typed must not become a second marker
        # (a picture count mismatch) or move the picture.
        text = text.replace(IMAGE_MARKER, "<image >").replace(_SLOT, IMAGE_MARKER)
        return {"text": text, "images": [self.picture()]}

    def reset(self, seed: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:  # type: ignore[override]
        obs, info = super().reset(seed)
        return self._with_picture(obs), info

    def step(self, action: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:  # type: ignore[override]
        obs, reward, terminated, truncated, info = super().step(action)
        return self._with_picture(obs), reward, terminated, truncated, info
