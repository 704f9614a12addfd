"""Dataset specs ``NAME:DIR[:SPLIT]``: each layout read from a tiny copy of its released form (the released
file names, MATLAB variables and struct fields, 1-based labels), a malformed file of each as a one-line error
naming it, and `openalign eval` tasks run on them end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from scipy.io import savemat

from openalign.cli import main
from openalign.eval.datasets import load_classification
from openalign.eval.released import parse_spec
from openalign.eval.templates import imagenet_classes, shipped_classnames, vtab1k_classnames

COLOURS = [(220, 30, 30), (30, 40, 220), (30, 200, 40), (230, 220, 30)]


def _jpg(path: Path, colour: int = 0, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    base = np.array(COLOURS[colour % len(COLOURS)], dtype=np.int16)
    pixels = np.clip(base + rng.integers(-20, 20, (20, 20, 3)), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format="JPEG")


def _struct(rows: list[dict], fields: list[str]) -> np.ndarray:
    """A 1×N MATLAB struct array, as the devkits store them."""
    array = np.empty((1, len(rows)), dtype=[(f, object) for f in fields])
    for i, row in enumerate(rows):
        array[0, i] = tuple(row[f] for f in fields)
    return array


def _one_line_error(call, *needles: str) -> str:
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


# ------------------------------------------------------------------------------------------ Flowers-102


def write_flowers(root: Path) -> Path:
    # image 1..6; labels 1-based; train {1, 2}, val {3}, test {4, 5, 6}
    labels = [1, 2, 1, 2, 1, 102]
    for i, label in enumerate(labels, 1):
        _jpg(root / "jpg" / f"image_{i:05d}.jpg", colour=label, seed=i)
    savemat(root / "imagelabels.mat", {"labels": np.array([labels], dtype=np.uint8)})
    savemat(
        root / "setid.mat",
        {"trnid": np.array([[1, 2]], np.uint16), "valid": np.array([[3]], np.uint16), "tstid": np.array([[4, 5, 6]])},
    )
    return root


def test_flowers102_splits_labels_and_clip_names(tmp_path: Path) -> None:
    root = write_flowers(tmp_path / "flowers")
    train = load_classification(f"flowers102:{root}:train")
    test = load_classification(f"flowers102:{root}")  # the default split is test
    trainval = load_classification(f"flowers:{root}:trainval")  # CLIP_benchmark's name
    assert train.labels == [0, 1] and test.labels == [1, 0, 101] and trainval.labels == [0, 1, 0]
    assert train.images.names == [str(root / "jpg" / f"image_{i:05d}.jpg") for i in (1, 2)]
    assert train.classnames[:2] == ["pink primrose", "hard-leaved pocket orchid"]
    assert len(test.classnames) == 102 and test.classnames[101] == "blackberry lily"
    assert train.class_ids == test.class_ids and test.name == "flowers102"
    assert len(list(test.images)) == 3


def test_flowers102_malformed_files(tmp_path: Path) -> None:
    root = write_flowers(tmp_path / "flowers")
    savemat(root / "setid.mat", {"trnid": np.array([[1, 2]]), "valid": np.array([[3]])})
    _one_line_error(lambda: load_classification(f"flowers102:{root}:test"), str(root / "setid.mat"), "'tstid'")
    write_flowers(root)
    savemat(root / "imagelabels.mat", {"labels": np.array([[1, 2, 0, 2, 1, 103]])})
    _one_line_error(lambda: load_classification(f"flowers102:{root}:test"), str(root / "imagelabels.mat"), "class 103")
    (root / "imagelabels.mat").write_bytes(b"not a mat file at all")
    _one_line_error(lambda: load_classification(f"flowers102:{root}"), str(root / "imagelabels.mat"))
    write_flowers(root)
    (root / "jpg" / "image_00005.jpg").unlink()
    _one_line_error(lambda: load_classification(f"flowers102:{root}"), str(root / "jpg" / "image_00005.jpg"))
    _one_line_error(lambda: load_classification(f"flowers102:{root}:dev"), "unknown split 'dev'", "trainval")


# ------------------------------------------------------------------------------------------ Pets


def write_pets(root: Path) -> Path:
    lines = {"trainval": ["Abyssinian_100 1 1 1", "american_bulldog_10 2 2 1"], "test": ["Abyssinian_201 1 1 1"]}
    lines["test"].append("yorkshire_terrier_9 37 2 25")
    (root / "annotations").mkdir(parents=True)
    for split, rows in lines.items():
        (root / "annotations" / f"{split}.txt").write_text("\n".join(rows) + "\n")
        for k, row in enumerate(rows):
            _jpg(root / "images" / f"{row.split()[0]}.jpg", colour=int(row.split()[1]), seed=k)
    return root


def test_pets_annotation_lists(tmp_path: Path) -> None:
    root = write_pets(tmp_path / "oxford-iiit-pet")
    trainval = load_classification(f"pets:{root}:trainval")
    train = load_classification(f"pets:{root}:train")
    test = load_classification(f"pets:{root}")
    assert trainval.labels == train.labels == [0, 1] and test.labels == [0, 36]
    assert test.images.names[1] == str(root / "images" / "yorkshire_terrier_9.jpg")
    assert test.classnames == list(shipped_classnames("pets")) and test.classnames[36] == "Yorkshire Terrier"
    assert test.name == "pets"


def test_pets_malformed_line(tmp_path: Path) -> None:
    root = write_pets(tmp_path / "pets")
    path = root / "annotations" / "test.txt"
    path.write_text("Abyssinian_201 1 1 1\nAbyssinian_202 one 1 1\n")
    _one_line_error(lambda: load_classification(f"pets:{root}"), f"{path}:2", "'one' is not a number")
    path.write_text("Abyssinian_201 1 1 1\nbeagle_3 1 2 1\n")
    _one_line_error(lambda: load_classification(f"pets:{root}"), f"{path}:2", "beagle_3 has class 1", "abyssinian")
    path.write_text("Abyssinian_201 38 1 1\n")
    _one_line_error(lambda: load_classification(f"pets:{root}"), f"{path}:1", "outside 1..37")
    (root / "annotations" / "trainval.txt").unlink()
    _one_line_error(lambda: load_classification(f"pets:{root}:trainval"), str(root / "annotations" / "trainval.txt"))


# ------------------------------------------------------------------------------------------ Stanford Cars

CAR_NAMES = ["AM General Hummer SUV 2000", "Acura RL Sedan 2012", "Acura TL Sedan 2012"]
BBOX = ["bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2"]


def _car(fname: str, cls: object, **extra: object) -> dict:
    return {"bbox_x1": 1, "bbox_y1": 2, "bbox_x2": 15, "bbox_y2": 16, "class": cls, "fname": fname, **extra}


def write_cars_devkit(root: Path) -> Path:
    (root / "devkit").mkdir(parents=True)
    savemat(root / "devkit" / "cars_meta.mat", {"class_names": np.array([CAR_NAMES], dtype=object)})
    fields = [*BBOX, "class", "fname"]
    train = [_car("00001.jpg", np.uint8(3)), _car("00002.jpg", np.uint8(1))]
    test = [_car("00001.jpg", 2), _car("00002.jpg", 3), _car("00003.jpg", 1)]
    savemat(root / "devkit" / "cars_train_annos.mat", {"annotations": _struct(train, fields)})
    savemat(root / "cars_test_annos_withlabels.mat", {"annotations": _struct(test, fields)})
    for split, rows in (("train", train), ("test", test)):
        for k, row in enumerate(rows):
            _jpg(root / f"cars_{split}" / row["fname"], colour=row["class"], seed=k)
    return root


def test_cars_devkit(tmp_path: Path) -> None:
    root = write_cars_devkit(tmp_path / "stanford_cars")
    train, test = load_classification(f"cars:{root}:train"), load_classification(f"cars:{root}")
    assert train.labels == [2, 0] and test.labels == [1, 2, 0]
    assert train.images.names == [str(root / "cars_train" / n) for n in ("00001.jpg", "00002.jpg")]
    assert test.classnames == CAR_NAMES and test.class_ids == train.class_ids and test.name == "cars"


def test_cars_single_annotation_file(tmp_path: Path) -> None:
    root = tmp_path / "cars"
    fields = ["relative_im_path", *BBOX, "class", "test"]
    rows = [
        # classes as MATLAB doubles
        {**_car("", 1.0), "relative_im_path": "car_ims/000001.jpg", "test": 0},
        {**_car("", 3.0), "relative_im_path": "car_ims/000002.jpg", "test": 1},
        {**_car("", 2.0), "relative_im_path": "car_ims/000003.jpg", "test": 0},
    ]
    root.mkdir()
    savemat(
        root / "cars_annos.mat",
        {"annotations": _struct(rows, fields), "class_names": np.array([CAR_NAMES], dtype=object)},
    )
    for k, row in enumerate(rows):
        _jpg(root / row["relative_im_path"], seed=k)
    train, test = load_classification(f"cars:{root}:train"), load_classification(f"cars:{root}:test")
    assert train.labels == [0, 1] and test.labels == [2]
    assert test.images.names == [str(root / "car_ims" / "000002.jpg")] and train.classnames == CAR_NAMES


def test_cars_malformed_annotations(tmp_path: Path) -> None:
    root = write_cars_devkit(tmp_path / "cars")
    path = root / "devkit" / "cars_train_annos.mat"
    savemat(path, {"annotations": _struct([{"fname": "00001.jpg", "label": 1}], ["fname", "label"])})
    _one_line_error(lambda: load_classification(f"cars:{root}:train"), str(path), "no field 'class'")
    savemat(path, {"annos": _struct([_car("00001.jpg", 1)], [*BBOX, "class", "fname"])})
    _one_line_error(lambda: load_classification(f"cars:{root}:train"), str(path), "no variable 'annotations'")
    savemat(path, {"annotations": _struct([_car("00001.jpg", 4)], [*BBOX, "class", "fname"])})
    _one_line_error(lambda: load_classification(f"cars:{root}:train"), f"{path}: annotation 1", "outside 1..3")
    (root / "cars_test_annos_withlabels.mat").unlink()
    _one_line_error(lambda: load_classification(f"cars:{root}"), "cars_test_annos_withlabels.mat")


# ------------------------------------------------------------------------------------------ Food-101


def write_food(root: Path) -> Path:
    meta = root / "meta"
    meta.mkdir(parents=True)
    (meta / "classes.txt").write_text("apple_pie\nbaby_back_ribs\nbaklava\n")
    (meta / "labels.txt").write_text("Apple pie\nBaby back ribs\nBaklava\n")
    (meta / "train.txt").write_text("apple_pie/1005649\nbaklava/17\n")
    (meta / "test.txt").write_text("baby_back_ribs/230\napple_pie/99\n")
    for line in ["apple_pie/1005649", "baklava/17", "baby_back_ribs/230", "apple_pie/99"]:
        _jpg(root / "images" / f"{line}.jpg", seed=len(line))
    return root


def test_food101_meta_lists(tmp_path: Path) -> None:
    root = write_food(tmp_path / "food-101")
    train, test = load_classification(f"food101:{root}:train"), load_classification(f"food101:{root}")
    assert train.labels == [0, 2] and test.labels == [1, 0]
    assert test.images.names[0] == str(root / "images" / "baby_back_ribs" / "230.jpg")
    assert test.classnames == ["apple pie", "baby back ribs", "baklava"]
    assert test.class_ids == ["apple_pie", "baby_back_ribs", "baklava"] and test.name == "food101"
    (root / "meta" / "labels.txt").unlink()  # without readable labels the class folder names are used
    assert load_classification(f"food101:{root}").classnames == ["apple pie", "baby back ribs", "baklava"]


def test_food101_malformed_list(tmp_path: Path) -> None:
    root = write_food(tmp_path / "food")
    path = root / "meta" / "test.txt"
    path.write_text("apple_pie/99\npizza/3\n")
    _one_line_error(lambda: load_classification(f"food101:{root}"), f"{path}:2", "'pizza/3'")
    path.write_text("apple_pie/98\n")
    _one_line_error(lambda: load_classification(f"food101:{root}"), str(root / "images" / "apple_pie" / "98.jpg"))


# ------------------------------------------------------------------------------------------ ImageNet

# The devkit numbers its 1000 leaf synsets by ILSVRC2012_ID, an order other than the sorted WordNet ids.
DEVKIT_IDS = {1: "n02119789", 2: "n02100735", 3: "n01440764"}


def write_imagenet(root: Path, labels: str = "devkit") -> Path:
    for k, wnid in enumerate(("n01440764", "n02119789")):
        _jpg(root / "train" / wnid / f"{wnid}_{k}.JPEG", colour=k, seed=k)
    truth = [1, 3, 2, 1]  # ground truth of images 1..4, as ILSVRC2012_IDs
    for n in range(1, len(truth) + 1):
        _jpg(root / "val" / f"ILSVRC2012_val_{n:08d}.JPEG", seed=n)
    if labels == "devkit":
        data = root / "ILSVRC2012_devkit_t12" / "data"
        data.mkdir(parents=True)
        (data / "ILSVRC2012_validation_ground_truth.txt").write_text("".join(f"{t}\n" for t in truth))
        fields = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children", "wordnet_height"]
        rows = [
            {"ILSVRC2012_ID": i, "WNID": w, "words": "x", "gloss": "y", "num_children": 0, "children": np.zeros(0)}
            | {"wordnet_height": 0}
            for i, w in DEVKIT_IDS.items()
        ]
        rows.append(rows[0] | {"ILSVRC2012_ID": 1001, "WNID": "n00001740", "num_children": 3})  # a non-leaf synset
        savemat(data / "meta.mat", {"synsets": _struct(rows, fields).T})
    else:
        header = "ImageId,PredictionString\n"
        body = "".join(
            f"ILSVRC2012_val_{n:08d},{DEVKIT_IDS[t]} 10 20 30 40 {DEVKIT_IDS[t]} 1 2 3 4\n"
            for n, t in reversed(list(enumerate(truth, 1)))
        )
        (root / "LOC_val_solution.csv").write_text(header + body)
    return root


@pytest.mark.parametrize("labels", ["devkit", "loc-csv"])
def test_imagenet_flat_validation(tmp_path: Path, labels: str) -> None:
    root = write_imagenet(tmp_path / "imagenet", labels)
    index = {c.wnid: c.index for c in imagenet_classes()}
    val = load_classification(f"imagenet:{root}:val")
    expected = [DEVKIT_IDS[t] for t in (1, 3, 2, 1)]
    assert val.labels == [index[w] for w in expected]
    assert val.images.names == [str(root / "val" / f"ILSVRC2012_val_{n:08d}.JPEG") for n in range(1, 5)]
    train = load_classification(f"imagenet1k:{root}:train")
    assert train.labels == [index["n01440764"], index["n02119789"]] and train.class_ids == val.class_ids
    # CLIP's names (index 7, n01514668, is "rooster" there; the WordNet lemma is "cock")
    assert len(val.classnames) == 1000 and val.classnames[7] == "rooster" and val.name == "imagenet"
    assert val.classnames == list(shipped_classnames("imagenet"))


def test_imagenet_val_class_folders(tmp_path: Path) -> None:
    root = tmp_path / "imagenet"
    _jpg(root / "val" / "n02119789" / "a.JPEG")
    (root / "val" / "n02119789" / "notes.txt").write_text("not an image")
    val = load_classification(f"imagenet:{root}")
    assert val.labels == [next(c.index for c in imagenet_classes() if c.wnid == "n02119789")]
    assert val.skipped_files == [str(root / "val" / "n02119789" / "notes.txt")]


def test_imagenet_malformed_labels(tmp_path: Path) -> None:
    root = write_imagenet(tmp_path / "a", "devkit")
    truth = root / "ILSVRC2012_devkit_t12" / "data" / "ILSVRC2012_validation_ground_truth.txt"
    truth.write_text("1\n3\n7\n")
    _one_line_error(lambda: load_classification(f"imagenet:{root}"), f"{truth}:3", "'7'")
    savemat(truth.parent / "meta.mat", {"synset": np.zeros(3)})
    _one_line_error(lambda: load_classification(f"imagenet:{root}"), str(truth.parent / "meta.mat"), "'synsets'")
    root = write_imagenet(tmp_path / "b", "loc-csv")
    (root / "LOC_val_solution.csv").write_text("ImageId,Labels\nILSVRC2012_val_00000001,n01440764\n")
    _one_line_error(lambda: load_classification(f"imagenet:{root}"), str(root / "LOC_val_solution.csv"), "header")
    (root / "LOC_val_solution.csv").write_text("ImageId,PredictionString\nILSVRC2012_val_00000001,\n")
    _one_line_error(lambda: load_classification(f"imagenet:{root}"), f"{root / 'LOC_val_solution.csv'}:2")
    (root / "LOC_val_solution.csv").unlink()
    _one_line_error(lambda: load_classification(f"imagenet:{root}"), "LOC_val_solution.csv", "ground_truth")


# ------------------------------------------------------------------------------------------ VTAB-1k


def write_vtab_task(root: Path, task: str, labels: dict[str, list[int]]) -> Path:
    folder = root / task
    for split, ys in labels.items():
        rows = []
        for k, y in enumerate(ys):
            rel = f"images/{split}/{k}.jpg"
            _jpg(folder / rel, colour=y, seed=k)
            rows.append(f"{rel} {y}")
        (folder / f"{split}.txt").write_text("\n".join(rows) + "\n")
    return folder


def test_vtab1k_list_files(tmp_path: Path) -> None:
    splits = {"train800": [0, 9], "val200": [3], "train800val200": [0, 9, 3], "test": [5, 5, 1]}
    folder = write_vtab_task(tmp_path / "vtab-1k", "eurosat", splits)
    train = load_classification(f"vtab1k:{folder}:train800val200")
    test = load_classification(f"vtab1k:{folder}")
    assert train.labels == [0, 9, 3] and test.labels == [5, 5, 1]
    assert test.images.names[0] == str(folder / "images" / "test" / "0.jpg")
    assert test.classnames == list(vtab1k_classnames()["eurosat"]) and test.name == "vtab1k/eurosat"
    assert load_classification(f"vtab1k:{folder}:val200").labels == [3]
    # A task without shipped names: the labels are the names, as many as the largest label needs.
    other = write_vtab_task(tmp_path / "vtab-1k", "dsprites_loc", {"test": [0, 4]})
    assert load_classification(f"vtab1k:{other}").classnames == ["0", "1", "2", "3", "4"]


def test_vtab1k_malformed_list(tmp_path: Path) -> None:
    folder = write_vtab_task(tmp_path / "vtab-1k", "eurosat", {"test": [1, 2]})
    path = folder / "test.txt"
    path.write_text("images/test/0.jpg 1\nimages/test/1.jpg -2\n")
    _one_line_error(lambda: load_classification(f"vtab1k:{folder}"), f"{path}:2", "PATH LABEL")
    path.write_text("images/test/0.jpg 10\n")
    _one_line_error(lambda: load_classification(f"vtab1k:{folder}"), str(path), "outside the 10 classes")
    _one_line_error(lambda: load_classification(f"vtab1k:{folder}:train800"), str(folder / "train800.txt"))


# ------------------------------------------------------------------------------------------ hardening


def test_annotation_paths_stay_inside_the_dataset_folder(tmp_path: Path) -> None:
    outside = tmp_path / "other" / "secret.jpg"
    _jpg(outside)
    # Cars: an annotation walking out with ..
    root = write_cars_devkit(tmp_path / "cars")
    rows = [_car("../../other/secret.jpg", 1), _car("00002.jpg", 2)]
    savemat(root / "cars_test_annos_withlabels.mat", {"annotations": _struct(rows, ["fname", "class"])})
    listed = root / "cars_test_annos_withlabels.mat"
    _one_line_error(lambda: load_classification(f"cars:{root}"), f"{listed}: annotation 1", "outside the dataset")
    # Food-101: a CLASS/ID line climbing out of its class folder
    root = write_food(tmp_path / "food")
    path = root / "meta" / "test.txt"
    path.write_text("apple_pie/99\napple_pie/../../../other/secret\n")
    _one_line_error(lambda: load_classification(f"food101:{root}"), f"{path}:2", "outside the dataset folder")
    # VTAB-1k: an absolute path, and a symlink pointing out
    folder = write_vtab_task(tmp_path / "vtab-1k", "eurosat", {"test": [1, 2]})
    path = folder / "test.txt"
    path.write_text(f"images/test/0.jpg 1\n{outside} 2\n")
    _one_line_error(lambda: load_classification(f"vtab1k:{folder}"), f"{path}:2", "outside the dataset folder")
    (folder / "images" / "link.jpg").symlink_to(outside)
    path.write_text("images/link.jpg 1\n")
    _one_line_error(lambda: load_classification(f"vtab1k:{folder}"), f"{path}:1", "outside the dataset folder")
    # Pets: an annotation naming a system file is refused before it is opened
    root = write_pets(tmp_path / "pets")
    path = root / "annotations" / "test.txt"
    path.write_text("../../../../../../../../etc/passwd 1 1 1\n")
    _one_line_error(lambda: load_classification(f"pets:{root}"), f"{path}:1", "outside the dataset folder")


def test_an_image_listed_twice_is_a_damaged_list(tmp_path: Path) -> None:
    root = write_flowers(tmp_path / "flowers")
    setid = root / "setid.mat"
    savemat(setid, {"trnid": np.array([[1, 2]]), "valid": np.array([[3]]), "tstid": np.array([[4, 5, 4]])})
    load = load_classification
    _one_line_error(lambda: load(f"flowers102:{root}"), f"{setid}: tstid entry 3 (image 4)", "listed again", "damaged")
    savemat(setid, {"trnid": np.array([[1, 2]]), "valid": np.array([[2]]), "tstid": np.array([[4]])})
    _one_line_error(lambda: load(f"flowers102:{root}:trainval"), f"{setid}: valid entry 1 (image 2)", "trnid entry 2")
    root = write_pets(tmp_path / "pets")
    path = root / "annotations" / "test.txt"
    path.write_text(path.read_text() * 2)
    _one_line_error(lambda: load_classification(f"pets:{root}"), f"{path}:3", "Abyssinian_201.jpg is listed again")
    root = write_food(tmp_path / "food")
    path = root / "meta" / "test.txt"
    path.write_text("apple_pie/99\nbaby_back_ribs/230\napple_pie/99\n")
    _one_line_error(lambda: load_classification(f"food101:{root}"), f"{path}:3", f"first at {path}:1")
    folder = write_vtab_task(tmp_path / "vtab-1k", "eurosat", {"test": [1, 2]})
    path = folder / "test.txt"
    path.write_text("images/test/0.jpg 1\nimages/test/1.jpg 2\nimages/test/../test/0.jpg 1\n")
    _one_line_error(lambda: load_classification(f"vtab1k:{folder}"), f"{path}:3", "listed again")
    root = write_imagenet(tmp_path / "imagenet", "loc-csv")
    solution = root / "LOC_val_solution.csv"
    solution.write_text(solution.read_text() + "ILSVRC2012_val_00000002,n01440764 1 2 3 4\n")
    _one_line_error(lambda: load_classification(f"imagenet:{root}"), f"{solution}:6", "listed again")


@pytest.mark.parametrize("labels", ["devkit", "loc-csv"])
def test_imagenet_labels_for_fewer_images_than_the_folder_holds(tmp_path: Path, labels: str) -> None:
    root = write_imagenet(tmp_path / "imagenet", labels)
    for n in (5, 6):
        _jpg(root / "val" / f"ILSVRC2012_val_{n:08d}.JPEG", seed=n)
    listed = (
        root / "ILSVRC2012_devkit_t12" / "data" / "ILSVRC2012_validation_ground_truth.txt"
        if labels == "devkit"
        else root / "LOC_val_solution.csv"
    )
    _one_line_error(
        lambda: load_classification(f"imagenet:{root}"),
        f"{listed}: labels for 4 images",
        f"{root / 'val'} holds 6 ILSVRC2012_val_* images",
        "ILSVRC2012_val_00000005",
    )
    (root / "val" / "notes.txt").write_text("not an image, not counted")
    for n in (5, 6):
        (root / "val" / f"ILSVRC2012_val_{n:08d}.JPEG").unlink()
    assert load_classification(f"imagenet:{root}").labels[:1] == [index_of(DEVKIT_IDS[1])]


def index_of(wnid: str) -> int:
    return next(c.index for c in imagenet_classes() if c.wnid == wnid)


# ------------------------------------------------------------------------------------------ specs


def test_spec_parsing(tmp_path: Path) -> None:
    assert parse_spec("dtd/train") is None and parse_spec("wds:x.tar") is None and parse_spec("a:b") is None
    spec = parse_spec(f"flowers:{tmp_path}:val")
    assert spec is not None and (spec.name, spec.root, spec.split) == ("flowers102", tmp_path, "val")
    # A colon inside the directory is kept there; a last part without a path separator is a split.
    spec = parse_spec(f"imagenet1k:{tmp_path}/x:y/z")
    assert spec is not None and (spec.name, spec.split) == ("imagenet", "val") and spec.root == tmp_path / "x:y" / "z"
    _one_line_error(lambda: parse_spec(f"imagenet:{tmp_path}/x:y"), "unknown split 'y' for imagenet", "val, train")
    _one_line_error(lambda: load_classification(f"cars:{tmp_path / 'none'}"), str(tmp_path / "none"), "cars")
    root = write_flowers(tmp_path / "f")
    _one_line_error(lambda: load_classification(f"flowers102:{root}", layout="wnids"), "layout 'wnids'")
    names = tmp_path / "names.txt"
    names.write_text("a\nb\n")
    _one_line_error(lambda: load_classification(f"flowers102:{root}", classnames=names), "2 class names", "102")
    names.write_text("".join(f"flower {i}\n" for i in range(102)))
    assert load_classification(f"flowers102:{root}", classnames=names).classnames[101] == "flower 101"


# ------------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conftest import save_tiny_checkpoint

    captions = ["a photo of a pink primrose", "a photo of a beagle"] * 20
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), captions, vocab_size=101, min_frequency=1)


def test_eval_tasks_on_flowers102_spec(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "flowers"
    labels = [1, 2] * 4 + [1, 2, 2]  # images 1..8 train, 9..11 test
    for i, label in enumerate(labels, 1):
        _jpg(root / "jpg" / f"image_{i:05d}.jpg", colour=label, seed=i)
    savemat(root / "imagelabels.mat", {"labels": np.array([labels])})
    savemat(
        root / "setid.mat",
        {"trnid": np.arange(1, 9)[None], "valid": np.array([[9]]), "tstid": np.array([[9, 10, 11]])},
    )
    out = tmp_path / "res"
    common = ["--model", str(checkpoint), "--train", f"flowers102:{root}:train", "--val", f"flowers102:{root}:test"]
    assert main(["eval", "knn", *common, "--out", str(out)]) == 0
    knn = json.loads((out / "knn-flowers102.json").read_text())
    assert knn["metrics"]["num_train"] == 8 and knn["metrics"]["num_val"] == 3
    assert knn["options"]["train"] == f"flowers102:{root}:train"
    assert main(["eval", "linear-probe", *common, "--method", "lbfgs", "--out", str(out)]) == 0
    probe = json.loads((out / "linear-probe-flowers102.json").read_text())
    assert probe["metrics"]["num_train"] == 8 and 0 <= probe["metrics"]["top1"] <= 100
    assert "flowers102" in (out / "results.md").read_text()

    argv = ["eval", "zeroshot", "--model", str(checkpoint), "--dataset", f"flowers102:{root}", "--no-ensemble"]
    assert main([*argv, "--out", str(out)]) == 0
    zs = json.loads((out / "zeroshot-flowers102.json").read_text())["metrics"]
    assert zs["num_classes"] == 102 and zs["num_images"] == 3
    assert len(zs["empty_classes"]) == 100 and "blackberry lily" in zs["empty_classes"]
    assert "pink primrose" not in zs["empty_classes"] and "hard-leaved pocket orchid" not in zs["empty_classes"]

    # A malformed file is one line naming it, exit 2, no traceback.
    savemat(root / "setid.mat", {"trnid": np.arange(1, 9)[None]})
    capsys.readouterr()
    assert main(["eval", "knn", *common]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(root / "setid.mat") in err and "Traceback" not in err


def test_suite_entry_takes_a_spec(checkpoint: Path, tmp_path: Path) -> None:
    import yaml

    root = write_pets(tmp_path / "pets")
    out = tmp_path / "res"
    suite = {
        "model": str(checkpoint),
        "out": str(out),
        "tasks": [{"task": "zeroshot", "dataset": f"pets:{root}:test", "ensemble": False}],
    }
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    assert main(["eval", "suite", str(path)]) == 0
    metrics = json.loads((out / "zeroshot-pets.json").read_text())["metrics"]
    assert metrics["num_images"] == 2 and metrics["num_classes"] == 37
    assert "Abyssinian" not in metrics["empty_classes"] and "Beagle" in metrics["empty_classes"]


def test_annotation_lists_may_start_with_a_byte_order_mark(tmp_path: Path) -> None:
    root = write_pets(tmp_path / "pets")
    path = root / "annotations" / "test.txt"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert load_classification(f"pets:{root}").labels == [0, 36]
    root = write_food(tmp_path / "food")
    for name in ("classes.txt", "test.txt"):
        path = root / "meta" / name
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert load_classification(f"food101:{root}").labels == [1, 0]
    folder = write_vtab_task(tmp_path / "vtab-1k", "eurosat", {"test": [1, 2]})
    path = folder / "test.txt"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert load_classification(f"vtab1k:{folder}").labels == [1, 2]
    root = write_imagenet(tmp_path / "imagenet", "loc-csv")
    path = root / "LOC_val_solution.csv"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert len(load_classification(f"imagenet:{root}").labels) == 4


def test_suite_reports_a_failed_entry_as_failed(checkpoint: Path, tmp_path: Path) -> None:
    from openalign.eval.suite import run_suite

    root = write_pets(tmp_path / "pets")
    (root / "images" / "yorkshire_terrier_9.jpg").unlink()
    out = tmp_path / "res"
    entry = {"task": "finetune", "recipe": "paper-finegrained", "steps": 1, "batch_size": 2}
    entry |= {"train": f"pets:{root}:trainval", "val": f"pets:{root}:test"}
    summary = run_suite({"model": str(checkpoint), "out": str(out), "tasks": [entry]})
    assert len(summary.failed) == 1 and "yorkshire_terrier_9.jpg" in summary.failed[0]
    for report in (summary.markdown, (out / "results.md").read_text()):
        row = next(line for line in report.splitlines() if line.startswith("| Table 6: Oxford Pets"))
        assert "| failed: FileNotFoundError: " in row and "yorkshire_terrier_9.jpg: image file not found" in row
        assert "not run" not in row and "\n- tasks[0] finetune: FileNotFoundError: " in report
        assert "| Table 6: Stanford Cars | top1 |  | 96.13 | not run |" in report


def test_vtab1k_labels_are_bounded_before_anything_is_sized_by_them(tmp_path: Path) -> None:
    # A task without a shipped class list has as many classes as its largest label needs; a label at the bound
    # is refused while reading the list, before a name or a classifier row is made for it. (The first case is
    # small enough to run safely on code without the bound; the ones after it are refused just the same.)
    folder = write_vtab_task(tmp_path / "vtab-1k", "dtd", {"test": [1, 2]})
    path = folder / "test.txt"
    path.write_text("images/test/0.jpg 1\nimages/test/1.jpg 100000\n")
    _one_line_error(lambda: load_classification(f"vtab1k:{folder}"), f"{path}:2", "beyond the 100000 classes")
    for label in ("30000000", "100000000000000000000", "9" * 5000):
        path.write_text(f"images/test/0.jpg 1\nimages/test/1.jpg {label}\n")
        _one_line_error(lambda: load_classification(f"vtab1k:{folder}"), f"{path}:2", "beyond the 100000 classes")
    for label in ("1e20", "²", "-1", "1.0"):
        path.write_text(f"images/test/0.jpg {label}\n")
        _one_line_error(lambda: load_classification(f"vtab1k:{folder}"), f"{path}:1", "expected 'PATH LABEL'")
    path.write_text("images/test/0.jpg 1\nimages/test/1.jpg 99999\n")  # the largest label allowed
    assert len(load_classification(f"vtab1k:{folder}").classnames) == 100_000
    shipped = write_vtab_task(tmp_path / "vtab-1k", "eurosat", {"test": [1, 2]})
    (shipped / "test.txt").write_text("images/test/0.jpg 1\nimages/test/1.jpg 30000000\n")
    _one_line_error(lambda: load_classification(f"vtab1k:{shipped}"), f"{shipped / 'test.txt'}:2", "the 10 classes")


@pytest.mark.parametrize(
    ("layout", "write", "split"),
    [
        ("flowers102", write_flowers, "train"),
        ("pets", write_pets, "test"),
        ("cars", write_cars_devkit, "train"),
        ("food101", write_food, "train"),
        ("imagenet", write_imagenet, "val"),
        ("vtab1k", lambda root: write_vtab_task(root, "eurosat", {"test": [5, 1]}), "test"),
    ],
)
def test_a_relative_dataset_folder_is_read_from_another_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, write, split: str
) -> None:
    folder = write(tmp_path / "data" / layout)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    relative = Path("..") / folder.relative_to(tmp_path)
    absolute = load_classification(f"{layout}:{folder}:{split}")
    got = load_classification(f"{layout}:{relative}:{split}")
    assert got.labels == absolute.labels and len(got.labels) > 0
    assert [Path(n).resolve() for n in got.images.names] == [Path(n).resolve() for n in absolute.images.names]
    assert len(list(got.images)) == len(got.labels)  # every image is found and decoded
