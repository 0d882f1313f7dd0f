#!/bin/sh
# Prints the project headers a public header includes, directly or not, by
# following its #include "..." lines (paths relative to the source root):
#   scripts/public-headers.sh client/kvrope.h   ->  rope/rope.h base/error.h ...
# `make install` installs them beside kvrope.h.
set -eu
seen=""
todo="$*"
while [ -n "$todo" ]; do
  set -- $todo
  f=$1
  shift
  todo="$*"
  for i in $(sed -n 's/^#include "\(.*\)"/\1/p' "$f"); do
    case " $seen " in
      *" $i "*) ;;
      *) seen="$seen $i"; todo="$todo $i" ;;
    esac
  done
done
echo $seen
