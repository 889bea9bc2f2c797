"""The engine: layouts (what a source holds, as boxes), plans (box copies proven to tile every target before any
byte is read), the streaming executor that carries a plan out in bounded memory, and the reference executor
that tests use as the oracle. Format-blind and family-blind: readers and families sit above it."""
