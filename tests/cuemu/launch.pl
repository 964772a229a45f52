#!/usr/bin/perl
# cuemu: rewrites the kernel launches of a CUDA source for the host compiler:
#   kernel<<<grid, block, shmem, stream>>>(args)  ->  cuemu::launcher(kernel, grid, block, shmem, stream)(args)
# (kernel may be a template's instance, k<T>), and dynamic shared memory:
#   extern __shared__ [__align__(n)] T name[];  ->  T *name = (T *)cuemu::dynamic_shared();
# (that one first: the rule below takes the other __shared__ declarations)
# Everything else (the #line directives too) is kept as it is, line for line.
local $/;
my $name = $ARGV[0];
my $src = <>;
print "#line 1 \"$name\"\n";
$src =~ s/(\b[A-Za-z_]\w*(?:<[^<>;()]*>)?)<<<(.*?)>>>/cuemu::launcher($1, $2)/gs;
$src =~ s/\bextern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([A-Za-z_][\w ]*?)\s+(\w+)\s*\[\s*\]\s*;/$1 *$2 = ($1 *)cuemu::dynamic_shared();/g;
# a block's static shared memory: a slot of the running block's (cuemu::shared_slot, NaN bytes
# when the block starts, the same for every thread of the block; a reference keeps the type):
#   __shared__ [__align__(n)] T name[N]...;  ->  T (&name)[N]... = *reinterpret_cast<T (*)[N]...>(cuemu::shared_slot(site, sizeof(T[N]...)));
#   (a scalar: T &name = ...)
$src =~ s{\b__shared__\s+(?:__align__\(\d+\)\s+)?([A-Za-z_][\w ]*?)\s+(\w+)\s*((?:\[[^\]]+\])*)\s*;}{
    my ($t, $n, $d) = ($1, $2, $3);
    my $ref = $d eq '' ? "$t &$n" : "$t (&$n)$d";
    "$ref = *reinterpret_cast<$t (*)$d>(cuemu::shared_slot([] { static char site; return (const void *)&site; }(), sizeof($t$d)));"
}ge;
print $src;
