"""Shared builders for the kernel tests: devices, tolerances, random paged caches."""

from __future__ import annotations

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# (atol, rtol) of kernel vs fp32 reference, per cache dtype
TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def randn(*shape: int, dtype: torch.dtype = torch.float32, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def make_block_tables(
    context_lens: list[int], page_size: int, num_pages: int, max_pages: int, g: torch.Generator
) -> torch.Tensor:
    """``[B, max_pages]`` int32: disjoint, shuffled pages per request, -1 padded."""
    pages = torch.randperm(num_pages, generator=g).tolist()
    tables = torch.full((len(context_lens), max_pages), -1, dtype=torch.int32)
    for b, n in enumerate(context_lens):
        need = -(-n // page_size)
        assert need <= max_pages and need <= len(pages), "not enough pages for the test case"
        tables[b, :need] = torch.tensor(pages[:need], dtype=torch.int32)
        pages = pages[need:]
    return tables.to(DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def covering_grid(
    dtypes: list[torch.dtype], groups: list[int], page_sizes: list[int], full: bool = ON_CUDA
) -> list:
    """pytest params over dtype x GQA group x page size.

    ``full``: the whole product; else every dtype x group pair once, with the page size
    rotating so that each page size still appears with every dtype and every group.
    """
    cases = []
    for i, (dtype, dtype_id) in enumerate(zip(dtypes, DTYPE_IDS, strict=True)):
        for j, group in enumerate(groups):
            pages = page_sizes if full else [page_sizes[(i + j) % len(page_sizes)]]
            for page_size in pages:
                cases.append(
                    pytest.param(
                        dtype, group, page_size, id=f"{dtype_id}-gqa{group}-page{page_size}"
                    )
                )
    return cases
