"""Real pictures and videos for the vision-language tests: drawn with PIL, fed to the families' own processors."""
import numpy as np


def picture(width, height, seed):
    """A real RGB picture: a background and a few filled ellipses, drawn with PIL."""
    from PIL import Image, ImageDraw

    rng = np.random.RandomState(seed)
    image = Image.new("RGB", (width, height), tuple(int(c) for c in rng.randint(0, 256, 3)))
    draw = ImageDraw.Draw(image)
    for _ in range(4):
        x, y = rng.randint(0, width // 2), rng.randint(0, height // 2)
        draw.ellipse([x, y, x + rng.randint(3, width // 2 + 3), y + rng.randint(3, height // 2 + 3)],
                     fill=tuple(int(c) for c in rng.randint(0, 256, 3)))
    return image


def clip(frames, width, height, seed):
    """A video: `frames` pictures of a scene drifting right, [frames, height, width, 3] uint8."""
    base = np.asarray(picture(width + frames, height, seed))
    return np.stack([base[:, i:i + width] for i in range(frames)])
