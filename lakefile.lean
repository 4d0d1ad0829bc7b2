import Lake
open Lake DSL

/-!
Lean 4 + Mathlib formalisation of the AEGIS theorems (Theorems 1-3, Proposition 1).

One pinned Mathlib release tag; `lean-toolchain` holds the same version and `lake-manifest.json`
the tag's commit (and its dependencies' commits).
Check with: `lake exe cache get && lake build` (see `proofs/README.md`).
-/

package «aegis» where
  leanOptions := #[
    ⟨`pp.unicode.fun, true⟩,
    ⟨`autoImplicit, false⟩,
    ⟨`relaxedAutoImplicit, false⟩,
    ⟨`maxSynthPendingDepth, .ofNat 3⟩
  ]

require "leanprover-community" / "mathlib" @ git "v4.24.0"

@[default_target]
lean_lib «Aegis» where
  srcDir := "proofs"
