"""DCP metadata whose Enum members are pickled by name, as getattr(EnumClass, 'NAME'): how
Python 3.11.2 (Debian 12's python3.11) pickles them, whichever torch writes the checkpoint
(3.10, 3.11.7, 3.12 pickle EnumClass(value)). `qstate doctor` reads such metadata, and
still refuses every other use of getattr with its one-line error (doctor/safeload.py)."""
import copyreg
import enum
import io
import pickle
import pickletools
import warnings

import pytest
import torch

from qstate_cli.doctor.safeload import load_checkpoint
from qstate_cli.errors import QstateError

dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint import metadata as dcp_md  # noqa: E402

from test_doctor_hostile import adamw_state  # noqa: E402  (a stepped AdamW's state dict)

REFUSED = r"\.metadata: refused: global 'builtins\.getattr' is not allowed in DCP metadata$"


def saved(tmp_path):
    """A real DCP directory of an AdamW state dict (as this Python pickles its metadata)."""
    ck = tmp_path / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"optimizer": adamw_state()}, checkpoint_id=str(ck))
    return ck


def repickled(ck, reduce_member) -> None:
    """Rewrite ck/.metadata with every _MEM_FORMAT_ENCODING member reduced by reduce_member."""
    with (ck / ".metadata").open("rb") as fh:
        md = pickle.load(fh)  # our own file, written just now
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.DEFAULT_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, dcp_md._MEM_FORMAT_ENCODING: reduce_member}
    pickler.dump(md)
    (ck / ".metadata").write_bytes(buf.getvalue())


def globals_in(path) -> set:
    """The globals a pickle names (STACK_GLOBAL's two strings, or GLOBAL's)."""
    out, strings = set(), []
    for op, arg, _ in pickletools.genops(path.read_bytes()):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            out.add(".".join(strings[-2:]))
        elif op.name == "GLOBAL":
            out.add(arg.replace(" ", "."))
    return out


def states(ck) -> dict:
    return load_checkpoint(ck)["optimizer"]["state"]


def test_enum_members_pickled_by_name_are_read(tmp_path):
    ck = saved(tmp_path)
    want = states(ck)
    repickled(ck, lambda member: (getattr, (type(member), member.name)))
    assert "builtins.getattr" in globals_in(ck / ".metadata")
    got = states(ck)
    assert got.keys() == want.keys()
    for key in want:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[key][name], want[key][name])


def test_a_real_save_under_this_python_is_read(tmp_path):
    """Under a Python that pickles Enum members by name (3.11.2) the real metadata holds
    getattr; under others it does not: the doctor reads both."""
    class Probe(enum.Enum):
        A = 1

    by_name = Probe.A.__reduce_ex__(pickle.DEFAULT_PROTOCOL)[0] is getattr
    ck = saved(tmp_path)
    assert ("builtins.getattr" in globals_in(ck / ".metadata")) == by_name
    assert set(states(ck)) == {"0", "1"}


@pytest.mark.parametrize("reduce_member", [
    lambda m: (getattr, (type(m), "__class__")),  # an attribute, not a member
    lambda m: (getattr, (type(m), "NOT_A_MEMBER")),
    lambda m: (getattr, (type(m), m.value)),  # not a name
    lambda m: (getattr, (dcp_md.Metadata, "__init__")),  # an allowed class that is no Enum
    lambda m: (getattr, (torch.Size, "count")),
    lambda m: (getattr, ("TORCH_CONTIGUOUS_FORMAT", "upper")),  # not a class
], ids=["dunder", "unknown-member", "value-not-name", "dataclass", "torch-size", "string"])
def test_every_other_getattr_is_refused_in_one_line(tmp_path, reduce_member):
    ck = saved(tmp_path)
    repickled(ck, reduce_member)
    with pytest.raises(QstateError, match=REFUSED):
        load_checkpoint(ck)


def test_a_path_pickled_by_python_3_13_is_read():
    """Python 3.13 moved PosixPath to pathlib._local and pickles storage_meta.checkpoint_id
    from there: every DCP checkpoint saved under 3.13 was refused ("global
    'pathlib._local.PosixPath' is not allowed"), whatever Python read it."""
    from pathlib import PurePosixPath

    from qstate_cli.doctor.safeload import _MetadataUnpickler

    data = b"\x80\x02cpathlib._local\nPosixPath\nq\x00X\x05\x00\x00\x00/ckptq\x01\x85q\x02Rq\x03."
    assert _MetadataUnpickler(io.BytesIO(data)).load() == PurePosixPath("/ckpt")
    with pytest.raises(Exception, match="not allowed"):  # the module's other names stay refused
        _MetadataUnpickler(io.BytesIO(data.replace(b"\nPosixPath\n", b"\nPath\n"))).load()
