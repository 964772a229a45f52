#!/usr/bin/perl
# cuemu: rewrites the kernel launches of a CUDA source for the host compiler:
#   kernel<<<grid, block, shmem, stream>>>(args)  ->  cuemu::launcher(kernel, grid, block, shmem, stream)(args)
# (kernel may be a template's instance, k<T>), and dynamic shared memory:
#   extern __shared__ [__align__(n)] T name[];  ->  T *name = (T *)cuemu::dynamic_shared();
# Everything else (the #line directives too) is kept as it is, line for line.
local $/;
my $name = $ARGV[0];
my $src = <>;
print "#line 1 \"$name\"\n";
$src =~ s/(\b[A-Za-z_]\w*(?:<[^<>;()]*>)?)<<<(.*?)>>>/cuemu::launcher($1, $2)/gs;
$src =~ s/\bextern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([A-Za-z_][\w ]*?)\s+(\w+)\s*\[\s*\]\s*;/$1 *$2 = ($1 *)cuemu::dynamic_shared();/g;
print $src;
