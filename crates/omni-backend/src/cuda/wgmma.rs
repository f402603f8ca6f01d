//! Inline-PTX text of Hopper's warpgroup MMA (`wgmma.mma_async` m64nNk16, bf16 in, f32
//! accumulators), generated for the kernels that use it (the MoE grouped GEMMs, the prefill
//! attention): one `asm volatile` statement per shape, with its operand list written out (PTX
//! names every accumulator register).

/// `"+f"(d[0]), ..., "+f"(d[regs - 1])`: the accumulators as read-write operands, or
/// write-only (`"=f"`) when the instruction does not read them (scale-d 0), so the compiler
/// moves no stale values into registers another wgmma may still be writing.
fn acc_constraints(regs: usize, write_only: bool) -> String {
    let c = if write_only { "=f" } else { "+f" };
    (0..regs)
        .map(|i| format!("\"{c}\"(d[{i}])"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `%lo, ..., %hi - 1`.
fn operands(lo: usize, hi: usize) -> String {
    (lo..hi)
        .map(|i| format!("%{i}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One `wgmma` m64n{n}k16 with both operands from shared memory (descriptors `da`, `db`,
/// K-major): accumulates into the `n / 2` floats of `d`, or with `overwrite` (scale-d 0)
/// replaces them.
pub(crate) fn ss_asm(n: usize, overwrite: bool) -> String {
    let regs = n / 2;
    let outs = operands(0, regs);
    let cons = acc_constraints(regs, overwrite);
    let (da, db, sd) = (regs, regs + 1, regs + 2);
    let scale_d = u32::from(!overwrite);
    format!(
        r#"asm volatile("{{\n.reg .pred p;\nsetp.ne.b32 p, %{sd}, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{outs}}}, %{da}, %{db}, p, 1, 1, 0, 0;\n}}\n"
                 : {cons}
                 : "l"(da), "l"(db), "r"({scale_d}));"#
    )
}

/// One `wgmma` m64n{n}k16 with A from the four bf16x2 registers `a[0..4]` and B from shared
/// memory (descriptor `db`) read MN-major (transpose-B 1), accumulating into the `n / 2` floats
/// of `d`.
pub(crate) fn rs_asm_tnsp_b(n: usize) -> String {
    let regs = n / 2;
    let outs = operands(0, regs);
    let cons = acc_constraints(regs, false);
    let a = operands(regs, regs + 4);
    let (db, sd) = (regs + 4, regs + 5);
    format!(
        r#"asm volatile("{{\n.reg .pred p;\nsetp.ne.b32 p, %{sd}, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{outs}}}, {{{a}}}, %{db}, p, 1, 1, 1;\n}}\n"
                 : {cons}
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_name_every_accumulator_and_operand() {
        let s = ss_asm(16, false);
        assert!(s.contains("m64n16k16"), "{s}");
        assert!(
            s.contains("{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9"),
            "{s}"
        );
        assert!(s.contains("\"+f\"(d[7])") && s.contains("\"r\"(1)"), "{s}");
        let w = ss_asm(16, true);
        assert!(w.contains("\"=f\"(d[0])") && w.contains("\"r\"(0)"), "{w}");
        let r = rs_asm_tnsp_b(128);
        assert!(r.contains("{%64, %65, %66, %67}, %68"), "{r}");
        assert!(r.contains("p, 1, 1, 1;"), "{r}");
    }
}
